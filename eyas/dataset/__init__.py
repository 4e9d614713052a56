"""Dataset stage: prompts -> the target's responses -> the tokenized table -> the draft vocab mapping."""
