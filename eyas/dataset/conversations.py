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
assistant-token mask is used. Otherwise the whole conversation is rendered to text and tokenized once, and
each assistant span is located in that text by character offsets: it starts where the rendering of the turns
before it, with the generation prompt, ends, and ends where the rendering through it ends (its end-of-turn
marker included); both renderings must be character prefixes of the whole, and the span must hold the turn's
content, or the span cannot be located and the conversation is refused, naming the turn (a template that
rewrites earlier turns, e.g. one that drops past reasoning, is one). Every token whose characters overlap a
span is trained on (the tokenizer's offset mapping), so role markers that are ordinary text, whose last
characters merge with the response's first into one token, work. A tokenizer without offsets (a slow, Python
one) locates spans by token prefixes instead, which such markers defeat. Without a chat template the
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
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DatasetError(
                    f"{path}:{line_no}: not UTF-8 text ({err}); expected JSONL in UTF-8: re-encode the file "
                    "(e.g. `iconv -f LATIN1 -t UTF-8`)"
                ) from None
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DatasetError(f"{path}:{line_no}: not a JSON object ({err}); expected one row a line") from err
                if not isinstance(row, dict):
                    raise DatasetError(
                        f"{path}:{line_no}: a JSON {type(row).__name__}, expected an object (one conversation a line)"
                    )
                rows.append(row)
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


def _template(tokenizer, turns: list[dict], generation_prompt: bool, tokenize: bool = True) -> list[int] | str:
    # return_dict=False: transformers 5 returns a BatchEncoding by default, whose list() is its keys
    rendered = tokenizer.apply_chat_template(
        turns, add_generation_prompt=generation_prompt, tokenize=tokenize, return_dict=False
    )
    return list(rendered) if tokenize else rendered


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
    if not getattr(tokenizer, "is_fast", False):
        return _render_by_token_prefixes(tokenizer, turns, where)
    text = _template(tokenizer, turns, generation_prompt=False, tokenize=False)
    spans = _assistant_spans(tokenizer, turns, text, where)
    # tokenized as apply_chat_template(tokenize=True) does: the template writes any special tokens itself
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    mask = [int(any(a < end and b > start for start, end in spans)) for a, b in offsets]
    return ids, mask


def _refusal(where: str, i: int, how: str) -> DatasetError:
    return DatasetError(
        f"{where}: assistant turn {i}: {how}, so its span cannot be located; expected a template whose rendering of "
        "a prefix of the conversation is a prefix of the whole (add {% generation %} tags to the template, or set "
        "dataset.reasoning='drop' if it rewrites past reasoning)"
    )


def _assistant_spans(tokenizer, turns: list[dict], text: str, where: str) -> list[tuple[int, int]]:
    """[start, end) character offsets in `text` (the whole conversation rendered) of every assistant turn."""
    spans = []
    for i, t in enumerate(turns):
        if t["role"] != "assistant":
            continue
        before = _template(tokenizer, turns[:i], generation_prompt=True, tokenize=False) if i else ""
        through = _template(tokenizer, turns[: i + 1], generation_prompt=False, tokenize=False)
        for name, part in (("the turns before it, with the generation prompt", before), ("it", through)):
            if not text.startswith(part):
                at = next((k for k, (a, b) in enumerate(zip(text, part)) if a != b), min(len(text), len(part)))
                raise _refusal(
                    where,
                    i,
                    f"the chat template renders the whole conversation differently than the turns through {name} "
                    f"(first difference at character {at}: {text[at : at + 30]!r} in the whole, "
                    f"{part[at : at + 30]!r} there)",
                )
        if t["content"].strip() not in text[len(before) : len(through)]:
            raise _refusal(
                where,
                i,
                f"the chat template renders it as {text[len(before) : len(through)]!r:.120} without its content",
            )
        spans.append((len(before), len(through)))
    return spans


def _render_by_token_prefixes(tokenizer, turns: list[dict], where: str) -> tuple[list[int], list[int]]:
    """A tokenizer without offsets: each assistant span is located by rendering the conversation up to the turn
    (with the generation prompt) and through it, each a token prefix of the whole conversation's rendering."""
    full = _template(tokenizer, turns, generation_prompt=False)
    mask = [0] * len(full)
    for i, t in enumerate(turns):
        if t["role"] != "assistant":
            continue
        start = _template(tokenizer, turns[:i], generation_prompt=True) if i else []
        end = _template(tokenizer, turns[: i + 1], generation_prompt=False)
        for name, part in (("the turns before it, with the generation prompt", start), ("it", end)):
            if full[: len(part)] != part:
                at = next((k for k, (a, b) in enumerate(zip(full, part)) if a != b), len(full))
                raise _refusal(
                    where,
                    i,
                    f"the chat template renders it differently inside the whole conversation than through {name} "
                    f"(first difference at token {at}; this tokenizer gives no character offsets, so a role marker "
                    "that is ordinary text and merges with the response's first token defeats it: use the target's "
                    "fast tokenizer, tokenizer.json)",
                )
        mask[len(start) : len(end)] = [1] * (len(end) - len(start))
    return full, mask
