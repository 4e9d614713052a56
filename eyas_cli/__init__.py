"""The `eyas` command line: the user's entry point, above the flows."""
