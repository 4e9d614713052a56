"""Prefect flows: one per stage, and `pipeline` chaining them."""
