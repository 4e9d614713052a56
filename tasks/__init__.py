"""Prefect tasks: thin wrappers around `eyas` that add progress, artifacts and retries."""
