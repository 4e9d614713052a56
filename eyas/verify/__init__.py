"""Verification stage: every shard against its manifest row, the dataset and the run config."""
