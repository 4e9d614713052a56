"""The shard set on disk: shard files, their manifest, extract.json, the quarantine; written and read only here."""
