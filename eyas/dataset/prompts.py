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
    if Path(path).is_dir():
        raise DatasetError(f"prompts file {path}: a directory, expected a JSONL file of prompts; name the file itself")
    rows = []
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = _json_row(line, f"{path}:{line_no}")
            check_conversation(row, f"{path}:{line_no}")
            rows.append(row)
            if num_samples and len(rows) == num_samples:
                break
    if not rows:
        raise DatasetError(f"prompts file {path}: no prompts found; expected JSONL rows {{id, conversations}}")
    return rows


def _json_row(line: bytes, where: str) -> dict:
    """One JSONL line as an object, or a DatasetError saying what the line is instead."""
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise DatasetError(
            f"{where}: not UTF-8 text ({err.reason} at byte {err.start}), expected JSONL in UTF-8; re-encode the file "
            "(e.g. `iconv -f LATIN1 -t UTF-8`)"
        ) from None
    except json.JSONDecodeError as err:
        raise DatasetError(f"{where}: not a JSON object ({err}); expected one prompt row a line") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a JSON {type(row).__name__}, expected an object (one prompt row a line)")
    return row


def check_conversation(row: dict, where: str) -> None:
    turns = row.get("conversations")
    if "id" not in row or not isinstance(turns, list) or not turns:
        raise DatasetError(
            f"{where}: expected {{id, conversations: [{{role, content}}, ...]}}, found keys {sorted(row)}"
        )
    bad = next((t for t in turns if not (isinstance(t, dict) and isinstance(t.get("content"), str))), None)
    if bad is not None:
        raise DatasetError(f"{where} (id {row['id']}): turn {bad!r:.80}; expected {{role, content: text}}")
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
