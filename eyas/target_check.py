"""config.json against the target's weights: the shapes the config predicts, read from the safetensors headers only.

    problem = config_shape_problem("models/kimi-k2.5", read_target_config("models/kimi-k2.5"), "language_model.")
    # None, or one message naming each field, each tensor, both shapes and the fix (eyas.target raises it)

A config whose hidden_size (or head count, vocab, latent rank...) is not the checkpoint's would be found only
when a stage loads the weights (transformers refuses them, or SGLang does, hours into a launch); every fact
eyas reads from config.json (hidden size, the drafter's fc width) would be wrong until then. The tensors
checked are the text model's that every Llama-style or DeepSeek-style checkpoint holds: the embedding and
lm_head, the final norm, and layer 0's norms, attention projections (grouped-query, or DeepSeek's multi-head
latent attention when the config has kv_lora_rank) and, when layer 0 is dense, its MLP. A tensor the
checkpoint does not hold under that name, or holds packed in an integer dtype (a quantized format), is not
checked. A sharded checkpoint is read through model.safetensors.index.json: only the headers of the files that
hold these tensors are read, and every file the index names must be there.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path

from eyas.fsio import read_safetensors_header

INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
# expert-count fields: a config with one of them has MoE layers (DeepSeek's first first_k_dense_replace are dense)
EXPERT_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts")

# tensor name (under the text model's prefix) -> its shape, each dimension an expression of config fields
COMMON = {
    "model.embed_tokens.weight": ("vocab_size", "hidden_size"),
    "lm_head.weight": ("vocab_size", "hidden_size"),
    "model.norm.weight": ("hidden_size",),
    "model.layers.0.input_layernorm.weight": ("hidden_size",),
    "model.layers.0.post_attention_layernorm.weight": ("hidden_size",),
}
GROUPED_QUERY_ATTENTION = {
    "model.layers.0.self_attn.q_proj.weight": ("num_attention_heads * head_dim", "hidden_size"),
    "model.layers.0.self_attn.k_proj.weight": ("num_key_value_heads * head_dim", "hidden_size"),
    "model.layers.0.self_attn.v_proj.weight": ("num_key_value_heads * head_dim", "hidden_size"),
    "model.layers.0.self_attn.o_proj.weight": ("hidden_size", "num_attention_heads * head_dim"),
}
LATENT_ATTENTION = {  # DeepSeek-V3 / Kimi (transformers' DeepseekV3Attention)
    "model.layers.0.self_attn.q_a_proj.weight": ("q_lora_rank", "hidden_size"),
    "model.layers.0.self_attn.q_a_layernorm.weight": ("q_lora_rank",),
    "model.layers.0.self_attn.q_b_proj.weight": (
        "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)",
        "q_lora_rank",
    ),
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": ("kv_lora_rank + qk_rope_head_dim", "hidden_size"),
    "model.layers.0.self_attn.kv_a_layernorm.weight": ("kv_lora_rank",),
    "model.layers.0.self_attn.kv_b_proj.weight": (
        "num_attention_heads * (qk_nope_head_dim + v_head_dim)",
        "kv_lora_rank",
    ),
    "model.layers.0.self_attn.o_proj.weight": ("hidden_size", "num_attention_heads * v_head_dim"),
}
LATENT_ATTENTION_NO_Q_LORA = {  # q_lora_rank null (DeepSeek-V2-Lite): one q projection
    "model.layers.0.self_attn.q_proj.weight": (
        "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)",
        "hidden_size",
    ),
}
DENSE_MLP = {
    "model.layers.0.mlp.gate_proj.weight": ("intermediate_size", "hidden_size"),
    "model.layers.0.mlp.up_proj.weight": ("intermediate_size", "hidden_size"),
    "model.layers.0.mlp.down_proj.weight": ("hidden_size", "intermediate_size"),
}


def predicted_shapes(text: dict) -> dict[str, tuple[str, ...]]:
    """{tensor name: shape as config expressions} for a text config (a wrapper's text_config)."""
    shapes = dict(COMMON)
    if text.get("kv_lora_rank") is not None:
        shapes |= LATENT_ATTENTION
        if text.get("q_lora_rank") is None:
            shapes = {k: v for k, v in shapes.items() if ".q_a_" not in k and ".q_b_" not in k}
            shapes |= LATENT_ATTENTION_NO_Q_LORA
    else:
        shapes |= GROUPED_QUERY_ATTENTION
    if not any(text.get(f) for f in EXPERT_FIELDS) or (text.get("first_k_dense_replace") or 0) > 0:
        shapes |= DENSE_MLP
    return shapes


def config_fields(text: dict) -> tuple[dict[str, int], dict[str, str]]:
    """(the integer fields the expressions read, {field: how it was derived} for those config.json lacks):
    head_dim is hidden_size / num_attention_heads and num_key_value_heads num_attention_heads when absent, as
    transformers' Llama does."""
    fields = {k: v for k, v in text.items() if isinstance(v, int) and not isinstance(v, bool)}
    derived = {}
    heads, hidden = fields.get("num_attention_heads"), fields.get("hidden_size")
    if "head_dim" not in fields and heads and hidden:
        fields["head_dim"], derived["head_dim"] = hidden // heads, "hidden_size / num_attention_heads"
    if "num_key_value_heads" not in fields and heads:
        fields["num_key_value_heads"], derived["num_key_value_heads"] = heads, "num_attention_heads"
    return fields, derived


def evaluate(expression: str, fields: dict[str, int]) -> int | None:
    """The value of a dimension's expression (field names, +, *, parentheses); None when a field is absent."""

    def value(node: ast.AST) -> int | None:
        if isinstance(node, ast.Name):
            return fields.get(node.id)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if left is None or right is None:
                return None
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(f"dimension {expression!r}: only field names, + and * are expressions here")

    return value(ast.parse(expression, mode="eval").body)


class _Refused(Exception):
    """A checkpoint whose files cannot be read as its index says (the message is the problem)."""


def weight_headers(model_path: Path, names: set[str]) -> dict[str, tuple[str, dict]]:
    """{name: (weight file, header entry)} of those `names` the checkpoint holds: through the index of a sharded
    checkpoint (only the files holding them are read), else every *.safetensors header."""
    index = model_path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise _Refused(
                f"target {model_path}: {INDEX_FILE} has no weight_map object; expected the index transformers writes "
                "({'metadata': ..., 'weight_map': {tensor: file}}): download it again"
            )
        absent = sorted({f for f in weight_map.values() if not (model_path / f).is_file()})
        if absent:
            raise _Refused(
                f"target {model_path}: {INDEX_FILE} names {len(set(weight_map.values()))} weight files, "
                f"{len(absent)} of them not there ({', '.join(absent[:4])}{' ...' if len(absent) > 4 else ''}); "
                "expected every file of the checkpoint: the download is incomplete, finish it"
            )
        files = sorted({weight_map[n] for n in names if n in weight_map})
    else:
        files = sorted(p.name for p in model_path.glob("*.safetensors"))
    found = {}
    for file in files:
        header = read_safetensors_header(model_path / file)
        found |= {n: (file, header[n]) for n in names if n in header}
    return found


def field_names(expression: str) -> list[str]:
    """The config fields a dimension's expression reads, in order."""
    nodes = ast.walk(ast.parse(expression, mode="eval"))
    return list(dict.fromkeys(n.id for n in nodes if isinstance(n, ast.Name)))


@dataclass
class Mismatch:
    name: str
    file: str
    found: list[int]
    expected: list[int | None]
    dims: tuple[str, ...]
    fields: dict[str, int]

    def differing(self) -> list[tuple[str, int | None]]:
        """(expression, the weights' size) of each dimension that disagrees (all of them, with None, when the
        rank does)."""
        if len(self.found) != len(self.expected):
            return [(d, None) for d in self.dims]
        return [(d, have) for d, want, have in zip(self.dims, self.expected, self.found) if want != have]

    def text(self) -> str:
        def shown(dim: str) -> str:
            values = re.sub(r"[A-Za-z_]\w*", lambda m: str(self.fields[m.group()]), dim)
            return dim if dim.isidentifier() else f"{dim} = {values}"

        dims = ", ".join(map(shown, self.dims))
        return f"{self.name} in {self.file} is {self.found}, config.json gives {self.expected} = [{dims}]"


def shape_mismatches(model_path: Path, text: dict, prefix: str) -> list[Mismatch]:
    """Every checked tensor whose shape is not the one the text config predicts."""
    fields, _ = config_fields(text)
    predicted = predicted_shapes(text)
    held = weight_headers(model_path, {prefix + k for k in predicted})
    mismatches = []
    for key, dims in predicted.items():
        if prefix + key not in held:
            continue
        file, entry = held[prefix + key]
        expected = [evaluate(d, fields) for d in dims]
        found = list(entry["shape"])
        if entry["dtype"] in FLOAT_DTYPES and None not in expected and found != expected:
            mismatches.append(Mismatch(prefix + key, file, found, expected, dims, fields))
    return mismatches


def config_shape_problem(model_path: str | Path, config: dict, prefix: str) -> str | None:
    """Why config.json does not describe the weights (`prefix`: where the text model's sit): one message naming
    each field, each tensor, both shapes and the fix; None when every checked tensor has the predicted shape."""
    model_path = Path(model_path)
    text = config.get("text_config") or config
    where = "text_config." if config.get("text_config") else ""
    try:
        mismatches = shape_mismatches(model_path, text, prefix)
    except _Refused as err:
        return str(err)
    if not mismatches:
        return None
    said: dict[str, set[int]] = {}  # a dimension that is one field: the value(s) the weights give that field
    for m in mismatches:
        for dim, have in m.differing():
            if dim.isidentifier() and have is not None:
                said.setdefault(dim, set()).add(have)
    # the fields of the other dimensions that disagree, unless the values the weights give above explain them
    fixed = {**config_fields(text)[0], **{f: min(v) for f, v in said.items() if len(v) == 1}}
    unsure = [
        f
        for m in mismatches
        for dim, have in m.differing()
        if have is None or evaluate(dim, fixed) != have
        for f in field_names(dim)
        if f not in said
    ]
    unsure = list(dict.fromkeys(unsure))
    _, derived = config_fields(text)
    fixes = [
        f"set {where}{f} to {min(v)}" if len(v) == 1 else f"{where}{f}: the weights disagree ({sorted(v)})"
        for f, v in said.items()
    ]
    if unsure:
        how = "".join(f" ({f} is not in config.json: {derived[f]})" for f in unsure if f in derived)
        fixes.append(f"check {', '.join(where + f for f in unsure)}{how}")
    fields = "; ".join(
        f"{where}{f} {text.get(f)}, the weights {min(v) if len(v) == 1 else sorted(v)}" for f, v in said.items()
    )
    more = f"; and {len(mismatches) - 4} more" if len(mismatches) > 4 else ""
    return (
        f"target {model_path}: config.json does not describe its weights{f' ({fields})' if fields else ''}: "
        f"{'; '.join(m.text() for m in mismatches[:4])}{more}; expected the config.json published with these "
        f"weights: {'; '.join(fixes)}, or use the weights this config is for"
    )
