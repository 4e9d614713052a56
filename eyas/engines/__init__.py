"""Serving engines as eyas meets them: launch commands, server lifecycle and the HTTP client."""
