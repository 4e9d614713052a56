"""Benchmark stage: acceptance on the reference engine or on SGLang, and the diagnosis of a low tau."""
