"""Training stage: smoke run, device preflight, the torchrun launch and the trainer it runs."""
