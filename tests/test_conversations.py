"""Bring-your-own conversations: the three shapes, every assistant turn masked (with and without a chat
template, and the template's own assistant mask), system prompts and reasoning by option."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from eyas.dataset.conversations import read_conversations, render_conversation, turn_options
from eyas.dataset.prompts import DatasetError

TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "def add(a, b):"},
    {"role": "assistant", "content": "<think>sum them</think>return a + b"},
    {"role": "user", "content": "and sub?"},
    {"role": "assistant", "content": "return a - b"},
]
CHATML = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# a template that drops the content of every assistant turn but the last: prefixes are not prefixes of the whole
FORGETFUL = (
    "{% for m in messages %}<|{{ m.role }}|>{% if m.role != 'assistant' or loop.last %}{{ m.content }}{% endif %}"
    "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# role markers that are ordinary text: "Assistant: " ends with a space that the tokenizer merges with the
# response's first word (" return"), so the generation prompt alone is not a token prefix of the conversation
PLAIN = (
    "{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)
TAGGED = (
    "{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|end|>"
    "{% endgeneration %}{% else %}{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tokenizer_with(template, tiny_target_dir, tmp_path):
    out = tmp_path / "tok"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_target_dir / name, out / name)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = template
    return tok


@pytest.mark.parametrize(
    "row, shape",
    [
        ({"id": "a", "conversations": TURNS}, "eyas"),
        ({"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "def add(a, b):"},
                            {"from": "gpt", "value": "return a + b"}]}, "sharegpt"),
        ({"messages": [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "x"}]}, "openai"),
    ],
)  # fmt: skip
def test_each_shape_is_detected_and_normalized(tmp_path, row, shape):
    (tmp_path / "c.jsonl").write_text(json.dumps(row) + "\n")
    rows, found = read_conversations(tmp_path / "c.jsonl")
    assert found == shape
    assert rows[0]["id"] == row.get("id", "row-000001")
    assert {t["role"] for t in rows[0]["conversations"]} <= {"system", "user", "assistant"}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "c.parquet")
    assert read_conversations(tmp_path / "c.parquet")[1] == shape


def test_unknown_shapes_roles_and_duplicate_ids_are_refused(tmp_path):
    bad = [({"text": "x"}, r"keys \['text'\]; expected one of"),
           ({"conversations": [{"from": "bot", "value": "x"}]}, r"ShareGPT turn from 'bot'; expected human, gpt"),
           ({"messages": [{"role": "tool", "content": "x"}]}, r"tool turns are not supported")]  # fmt: skip
    for row, message in bad:
        (tmp_path / "c.jsonl").write_text(json.dumps(row) + "\n")
        with pytest.raises(DatasetError, match=message):
            read_conversations(tmp_path / "c.jsonl")
    (tmp_path / "c.jsonl").write_text(json.dumps({"id": "a", "conversations": TURNS}) * 1 + "\n"
                                      + json.dumps({"id": "a", "conversations": TURNS}) + "\n")  # fmt: skip
    with pytest.raises(DatasetError, match=r"id 'a' appears more than once"):
        read_conversations(tmp_path / "c.jsonl")


def test_system_and_reasoning_follow_the_options():
    drop = turn_options(TURNS, "drop", "drop")
    assert drop[0]["role"] == "user" and drop[1]["content"] == "return a + b"
    keep = turn_options(TURNS, "keep", "keep")
    assert keep[0]["role"] == "system" and keep[2]["content"] == "<think>sum them</think>return a + b"
    template = turn_options(TURNS, "keep", "template")
    assert template[2] == {"role": "assistant", "content": "return a + b", "reasoning_content": "sum them"}
    given = [{"role": "assistant", "content": "x", "reasoning_content": "why"}]
    assert turn_options(given, "keep", "keep")[0]["content"] == "<think>why</think>x"


def assistant_text(tok, ids, mask) -> list[str]:
    spans, current = [], []
    for t, m in zip(ids, mask):
        if m:
            current.append(t)
        elif current:
            spans.append(tok.decode(current))
            current = []
    return spans + ([tok.decode(current)] if current else [])


def test_without_a_template_every_assistant_turn_is_masked(tiny_target_dir):
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    turns = turn_options(TURNS, "drop", "drop")
    ids, mask = render_conversation(tok, turns)
    assert assistant_text(tok, ids, mask) == ["return a + b", "return a - b"]
    assert (
        len(ids) == len(mask) and ids[: mask.index(1)] == tok("def add(a, b):", add_special_tokens=False)["input_ids"]
    )


def test_with_a_template_the_spans_are_found_and_checked(tiny_target_dir, tmp_path):
    tok = tokenizer_with(CHATML, tiny_target_dir, tmp_path)
    ids, mask = render_conversation(tok, turn_options(TURNS, "keep", "drop"))
    assert ids == tok.apply_chat_template(turn_options(TURNS, "keep", "drop"), tokenize=True, return_dict=False)
    assert assistant_text(tok, ids, mask) == ["return a + b<|end|>", "return a - b<|end|>"]


def test_role_markers_that_are_ordinary_text_are_masked_by_character_offsets(tiny_target_dir, tmp_path):
    tok = tokenizer_with(PLAIN, tiny_target_dir, tmp_path)
    turns = turn_options(TURNS, "keep", "drop")
    prompt = tok.apply_chat_template(turns[:2], add_generation_prompt=True, tokenize=True, return_dict=False)
    whole = tok.apply_chat_template(turns, tokenize=True, return_dict=False)
    assert whole[: len(prompt)] != prompt  # what a token-prefix search cannot get past
    ids, mask = render_conversation(tok, turns)
    assert ids == whole and len(mask) == len(ids)
    # the trainable tokens are the assistant turns (with the newline that ends them), the first one of each
    # carrying the marker's space it merged with
    assert assistant_text(tok, ids, mask) == [" return a + b\n", " return a - b\n"]
    assert tok.decode([i for i, m in zip(ids, mask) if not m]) == (
        "System: Be brief.\nUser: def add(a, b):\nAssistant:User: and sub?\nAssistant:"
    )


def test_a_tokenizer_without_offsets_locates_spans_by_token_prefixes(tmp_path):
    from transformers import ByT5Tokenizer  # a Python tokenizer (bytes, no files): no offset mapping

    tok = ByT5Tokenizer()
    tok.chat_template = PLAIN
    assert not tok.is_fast
    ids, mask = render_conversation(tok, turn_options(TURNS, "keep", "drop"))
    assert assistant_text(tok, ids, mask) == ["return a + b\n", "return a - b\n"]


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_turn(tiny_target_dir, tmp_path):
    tok = tokenizer_with(FORGETFUL, tiny_target_dir, tmp_path)
    with pytest.raises(DatasetError) as err:
        render_conversation(tok, turn_options(TURNS, "keep", "drop"), where="conversation a")
    assert str(err.value) == (
        "conversation a: assistant turn 2: the chat template renders the whole conversation differently than the "
        "turns through it (first difference at character 68: '<|end|><|user|>and sub?<|end|>' in the whole, "
        "'return a + b<|end|>' there), so its span cannot be located; expected a template whose rendering of a "
        "prefix of the conversation is a prefix of the whole (add {% generation %} tags to the template, or set "
        "dataset.reasoning='drop' if it rewrites past reasoning)"
    )


def test_a_template_that_renders_a_turn_without_its_content_is_refused(tiny_target_dir, tmp_path):
    blank = CHATML.replace("{{ m.content }}", "{% if m.role != 'assistant' %}{{ m.content }}{% endif %}")
    tok = tokenizer_with(blank, tiny_target_dir, tmp_path)
    with pytest.raises(DatasetError, match=r"^conversation b: assistant turn 2: the chat template renders it as "):
        render_conversation(tok, turn_options(TURNS, "keep", "drop"), where="conversation b")


def test_a_template_with_generation_tags_gives_its_own_mask(tiny_target_dir, tmp_path):
    tok = tokenizer_with(TAGGED, tiny_target_dir, tmp_path)
    ids, mask = render_conversation(tok, turn_options(TURNS, "keep", "drop"))
    assert assistant_text(tok, ids, mask) == ["return a + b<|end|>", "return a - b<|end|>"]


def test_a_templated_prompt_is_its_token_ids(tiny_target_dir, tmp_path):
    """transformers 5's apply_chat_template returns a BatchEncoding unless told otherwise: list() of it would be
    its keys, ['input_ids', 'attention_mask'], not the prompt."""
    from eyas.dataset.prompts import prompt_token_ids

    tok = tokenizer_with(CHATML, tiny_target_dir, tmp_path)
    ids = prompt_token_ids(tok, [{"role": "user", "content": "def add(a, b):"}])
    assert all(isinstance(i, int) for i in ids) and tok.decode(ids) == "<|user|>def add(a, b):<|end|><|assistant|>"


def test_bytes_that_are_not_utf8_and_rows_that_are_not_objects_are_refused_naming_the_line(tmp_path):
    path = tmp_path / "c.jsonl"
    good = json.dumps({"id": "a", "conversations": [{"role": "user", "content": "hi"}]}) + "\n"
    path.write_bytes(
        good.encode() + '{"id": "b", "conversations": [{"role": "user", "content": "café"}]}\n'.encode("latin-1")
    )
    with pytest.raises(DatasetError, match=r"c\.jsonl:2: not UTF-8 text \(.*\); expected JSONL in UTF-8: re-encode"):
        read_conversations(path)
    path.write_text(good + '["not", "a", "row"]\n')
    with pytest.raises(DatasetError, match=r"c\.jsonl:2: a JSON list, expected an object \(one conversation a line\)"):
        read_conversations(path)
