"""Extraction stage: the target's hidden states into shards, by workers on disjoint shard lists."""
