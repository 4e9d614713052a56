"""Conversations in the shapes people have them, and their rendering into tokens with every assistant turn masked.

    rows, shape = read_conversations("chats.jsonl")          # JSONL or Parquet; shape named for the report
    ids, mask = render_conversation(tokenizer, turns)        # loss mask 1 on every assistant turn's tokens

Shapes, detected per file from its first row and named in the report:
- "eyas": {id, conversations: [{role, content}]} (roles system, user, assistant);
- "sharegpt": {id?, conversations: [{from: human|gpt|system, value}]};
- "openai": {id?, messages: [{role, content}]}.
A row without an id gets its line number (`row-000042`). A `reasoning_content` field of an assistant turn
and `<think>...</think>` at the start of its content are reasoning; `turn_options` applies
dataset.system_prompt (keep | drop) and dataset.reasoning (keep: left in the content as written; drop:
removed; template: handed to the chat template as `reasoning_content`, rendered as the model was trained).

Rendering. With a chat template whose assistant turns carry `{% generation %}` tags, the tokenizer's own
assistant-token mask is used. Otherwise each assistant span is found by rendering the conversation up to the
turn (with the generation prompt) and through it; every such rendering must be a token prefix of the whole
conversation's rendering, or the template cannot be checked and the conversation is refused (a template
that rewrites earlier turns, e.g. one that drops past reasoning, is one). Without a chat template the
rendering is each turn's text tokenized on its own, concatenated (what regeneration does: prompt tokens,
then the response's).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from eyas.dataset.prompts import DatasetError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


def _rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        from eyas.dataset.table import parquet_errors

        with parquet_errors(path, "conversations file", "a Parquet table of conversations (or JSONL)"):
            return pq.read_table(path).to_pylist()
    rows = []
    with open(path, encoding="utf-8", errors="strict") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DatasetError(f"{path}:{line_no}: not a JSON object ({err}); expected one row a line") from err
    return rows


def detect_shape(row: dict, where: str) -> str:
    if isinstance(row.get("messages"), list):
        return "openai"
    turns = row.get("conversations")
    if isinstance(turns, list) and turns and isinstance(turns[0], dict):
        if "from" in turns[0] and "value" in turns[0]:
            return "sharegpt"
        if "role" in turns[0] and "content" in turns[0]:
            return "eyas"
    raise DatasetError(
        f"{where}: keys {sorted(row)}; expected one of {{id, conversations: [{{role, content}}]}}, ShareGPT "
        "{conversations: [{from, value}]} or OpenAI {messages: [{role, content}]}"
    )


def normalize(row: dict, shape: str, where: str) -> list[dict]:
    """The row's turns as [{role, content, reasoning_content?}] with roles system | user | assistant."""
    if shape == "sharegpt":
        turns = []
        for t in row["conversations"]:
            role = SHAREGPT_ROLES.get(str(t.get("from")))
            if role is None:
                raise DatasetError(f"{where}: ShareGPT turn from {t.get('from')!r}; expected human, gpt or system")
            turns.append({"role": role, "content": t.get("value") or ""})
        return turns
    raw = row["messages"] if shape == "openai" else row["conversations"]
    turns = []
    for t in raw:
        if t.get("role") not in ("system", "user", "assistant") or not isinstance(t.get("content"), str):
            raise DatasetError(
                f"{where}: turn {t!r:.120}; expected {{role: system|user|assistant, content: text}} (tool turns "
                "are not supported)"
            )
        turns.append({k: t[k] for k in ("role", "content", "reasoning_content") if k in t})
    return turns


def read_conversations(path: str | Path, num_samples: int = 0) -> tuple[list[dict], str]:
    """([{id, conversations}], shape) of a JSONL or Parquet file of conversations."""
    path = Path(path)
    rows = _rows(path)
    if not rows:
        raise DatasetError(f"conversations file {path}: no rows; expected JSONL or Parquet rows of conversations")
    shape = detect_shape(rows[0], f"{path} row 1")
    out = []
    for i, row in enumerate(rows[: num_samples or None], 1):
        where = f"{path} row {i}"
        if detect_shape(row, where) != shape:
            raise DatasetError(
                f"{where}: shape {detect_shape(row, where)}, the file's first row is {shape}; one shape a file"
            )
        out.append({"id": str(row.get("id", f"row-{i:06d}")), "conversations": normalize(row, shape, where)})
    ids = [r["id"] for r in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DatasetError(f"conversations file {path}: id {dup!r} appears more than once; expected unique ids")
    return out, shape


def turn_options(turns: list[dict], system_prompt: str, reasoning: str) -> list[dict]:
    """Apply dataset.system_prompt and dataset.reasoning to a conversation's turns."""
    out = []
    for t in turns:
        if t["role"] == "system" and system_prompt == "drop":
            continue
        t = dict(t)
        if t["role"] == "assistant":
            thought = t.pop("reasoning_content", None)
            match = THINK.match(t["content"])
            if match and thought is None:
                thought, t["content"] = match.group(1).strip(), t["content"][match.end() :]
            elif match:
                t["content"] = t["content"][match.end() :]
            if thought is not None and reasoning == "keep":
                t["content"] = f"<think>{thought}</think>{t['content']}"
            elif thought is not None and reasoning == "template":
                t["reasoning_content"] = thought
        out.append(t)
    return out


def _template(tokenizer, turns: list[dict], generation_prompt: bool) -> list[int]:
    # return_dict=False: transformers 5 returns a BatchEncoding by default, whose list() is its keys
    rendered = tokenizer.apply_chat_template(
        turns, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
    )
    return list(rendered)


def render_conversation(tokenizer, turns: list[dict], where: str = "conversation") -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a whole conversation: mask 1 on every assistant turn's tokens."""
    if not any(t["role"] == "assistant" for t in turns):
        raise DatasetError(f"{where}: no assistant turn; expected at least one to train on")
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        ids, mask = [], []
        for t in turns:
            piece = tokenizer(t["content"], add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [int(t["role"] == "assistant")] * len(piece)
        return ids, mask
    if "{% generation %}" in template or "{%- generation %}" in template:
        out = tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        return list(out["input_ids"]), list(out["assistant_masks"])
    full = _template(tokenizer, turns, generation_prompt=False)
    mask = [0] * len(full)
    for i, t in enumerate(turns):
        if t["role"] != "assistant":
            continue
        start = _template(tokenizer, turns[:i], generation_prompt=True) if i else []
        end = _template(tokenizer, turns[: i + 1], generation_prompt=False)
        for name, part in (("the turns before it, with the generation prompt", start), ("it", end)):
            if full[: len(part)] != part:
                raise DatasetError(
                    f"{where}: the chat template renders assistant turn {i} differently inside the whole "
                    f"conversation than through {name} (first difference at token "
                    f"{next((k for k, (a, b) in enumerate(zip(full, part)) if a != b), len(full))}), so its span "
                    "cannot be found and checked; expected a template whose rendering of a prefix is a prefix of "
                    "the whole (add {% generation %} tags to the template, or set dataset.reasoning='drop' if it "
                    "rewrites past reasoning)"
                )
        mask[len(start) : len(end)] = [1] * (len(end) - len(start))
    return full, mask
