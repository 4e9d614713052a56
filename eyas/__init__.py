"""eyas: the library (pure Python + torch, no Prefect). Flows and tasks wrap it; torchrun runs it."""

__version__ = "0.1.0"
