"""The approval gate's table of draft modules: every module in forward order, its parameters and whether it trains.

rows = module_table(draft)     # [{"module", "num_params", "shapes", "trainable"}, ...]
"""

from __future__ import annotations

from eyas.draft import Eagle3Draft
from eyas.draft_keys import layer_prefixes

# Rows of the approval gate's module table, in forward order, for a plain single-layer draft (module_rows).
MODULE_ROWS = (
    "embed_tokens",
    "fc",
    "midlayer.input_layernorm",
    "midlayer.hidden_norm",
    "midlayer.self_attn",
    "midlayer.post_attention_layernorm",
    "midlayer.mlp",
    "norm",
    "lm_head",
)


def module_rows(draft: Eagle3Draft) -> tuple[str, ...]:
    """The module table's rows of `draft` in forward order: MODULE_ROWS with the variant's norms before fc and
    the submodules of every decoder layer (a later layer has no input_layernorm)."""
    options = [name for name in ("input_norm", "fc_norm") if hasattr(draft, name)]
    prefixes = layer_prefixes(draft.arch.num_layers)
    layers = [
        f"{prefix}{name}"
        for prefix, layer in zip(prefixes, draft.decoder_layers(), strict=True)
        for name, _ in layer.named_children()
    ]
    return ("embed_tokens", *options, "fc", *layers, "norm", "lm_head")


def module_table(draft: Eagle3Draft) -> list[dict]:
    """One row per draft module: name, parameter count, parameter shapes, trainable (all its params)."""
    modules = dict(draft.named_modules())
    rows, covered = [], set()
    rows_of = module_rows(draft)
    for name in rows_of:
        params = dict(modules[name].named_parameters())
        covered.update(f"{name}.{p}" for p in params)
        rows.append(
            {
                "module": name,
                "num_params": sum(p.numel() for p in params.values()),
                "shapes": {p: list(t.shape) for p, t in params.items()},
                "trainable": all(t.requires_grad for t in params.values()),
            }
        )
    uncovered = sorted(dict(draft.named_parameters()).keys() - covered)
    if uncovered:
        raise ValueError(f"module_table: parameters {uncovered} belong to no row of {rows_of}; add their module")
    return rows
