"""Export stage: checkpoint formats as data, conversion between them, and the audit of any drafter directory."""
