"""Prompts for regeneration: JSONL rows `{id, conversations: [{role, content}, ...]}` whose last turn is
the user's (the target writes the next assistant turn), and their encoding with the target's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

ROLES = ("user", "assistant")


class DatasetError(ValueError):
    """The prompts or the tokenized samples are unusable for training."""


def read_prompts(path: str | Path, num_samples: int = 0) -> list[dict]:
    """The first `num_samples` rows (0 = all), each checked by `check_conversation`."""
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            check_conversation(row, f"{path}:{line_no}")
            rows.append(row)
            if num_samples and len(rows) == num_samples:
                break
    if not rows:
        raise DatasetError(f"prompts file {path}: no prompts found; expected JSONL rows {{id, conversations}}")
    return rows


def check_conversation(row: dict, where: str) -> None:
    turns = row.get("conversations")
    if "id" not in row or not isinstance(turns, list) or not turns:
        raise DatasetError(
            f"{where}: expected {{id, conversations: [{{role, content}}, ...]}}, found keys {sorted(row)}"
        )
    if turns[0].get("role") == "system":
        turns = turns[1:]
    roles = [t.get("role") for t in turns]
    expected = [ROLES[i % 2] for i in range(len(roles))]
    if roles != expected or roles[-1] != "user":
        raise DatasetError(
            f"{where} (id {row['id']}): roles {roles}; expected alternating user/assistant ending with "
            f"user (the target writes the next assistant turn); fix the conversation's roles"
        )


def prompt_token_ids(tokenizer, conversation: list[dict]) -> list[int]:
    """The prompt as the target sees it: the chat template with a generation prompt, else the raw text."""
    if getattr(tokenizer, "chat_template", None):
        # return_dict=False: transformers 5 returns a BatchEncoding by default, whose list() is its keys
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)
    return tokenizer("".join(t["content"] for t in conversation), add_special_tokens=False)["input_ids"]
