"""Any drafter directory, read into the eyas form: the one reader behind remap, the benchmark and diagnosis.

    producer, ckpt = read_drafter("hub/eagle3-llama", num_target_layers=32)   # DraftCheckpoint, eyas keys
    draft = load_exported_draft("run/export/sglang", target_embed)            # what the engine would run

The producer and format come from eyas.export.producers, the config is read by eyas.export.configs with
every problem an error, the key set is checked against the format's exact one (draft options included),
then the tensors are renamed to eyas keys. Weights are model.safetensors or pytorch_model.bin (loaded with
`torch.load(weights_only=True)`: nothing but tensors is unpickled). A draft whose vocab is the full target
vocab may come without d2t/t2d (speculators writes none then): the identity mapping is derived.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eyas.dataset.vocab import check_vocab_mapping
from eyas.draft import DraftArch, Eagle3Draft
from eyas.export.configs import ConfigError, read_config
from eyas.export.drafter_dir import (
    BIN_FILE,
    CONFIG_FILE,
    ExportError,
    read_export_provenance,
    recorded_numbering,
    tensor_shapes,
    weights_file,
)
from eyas.export.keys import (
    check_keys,
    derivable_keys,
    expected_shapes,
    format_convention,
    get_format,
    invert_key_map,
)
from eyas.export.producers import Producer, identify_producer
from eyas.fsio import checked_safetensors_header
from eyas.layer_ids import default_aux_layer_ids
from eyas.train.checkpoint import DraftCheckpoint, read_checkpoint

# the target input embedding's names: an eyas checkpoint's, a causal LM's, a wrapper's (Kimi-K2.5)
EMBED_KEYS = ("embed_tokens.weight", "model.embed_tokens.weight", "language_model.model.embed_tokens.weight")


def arch_from_config(fmt: str, config: dict, where: str, producer: str | None = None, convention: str | None = None):
    """(DraftArch, canonical aux layer ids or None) from a `fmt` config; every problem found is one ExportError."""
    try:
        info = read_config(fmt, config, producer, convention)
    except ConfigError as err:
        raise ExportError(f"{where}: {err}") from err
    if info.problems:
        raise ExportError(f"{where} ({fmt} format): " + "; ".join(info.problems))
    return DraftArch(**info.arch), info.aux_layer_ids


def read_drafter(
    src: str | Path,
    *,
    embed_from: str | Path | None = None,
    num_target_layers: int | None = None,
    target_architectures: list[str] | None = None,
) -> tuple[Producer, DraftCheckpoint]:
    """(producer, the draft in the eyas form) from a drafter directory of any format and producer; the target's
    layer count names ids a config leaves out, its architectures choose the numbering SGLang ids are in."""
    root = Path(src)
    weights = weights_file(root)
    found = tensor_shapes(weights)
    producer = identify_producer(root, found)
    fmt = producer.format
    if fmt == "eyas":
        ckpt = read_checkpoint(root)
    else:
        config = json.loads((root / CONFIG_FILE).read_text())
        # without the target, the numbering eyas's export recorded (a Kimi drafter's ids are not Llama's)
        recorded = None if target_architectures else recorded_numbering(read_export_provenance(root), fmt)
        convention = recorded or format_convention(fmt, target_architectures)
        arch, ids = arch_from_config(fmt, config, f"{root}/{CONFIG_FILE}", producer.name, convention)
        derivable = derivable_keys(fmt, arch, found)
        expected = expected_shapes(fmt, arch)
        found = {**found, **{k: expected[k] for k in derivable}}
        check_keys(found, expected, where=f"{weights} ({fmt} format)", fmt=fmt)
        tensors = _load_tensors(weights)
        if "d2t" in derivable:
            tensors["d2t"] = torch.zeros(arch.draft_vocab_size, dtype=torch.int64)
            tensors["t2d"] = torch.ones(arch.target_vocab_size, dtype=torch.bool)
        key_map = get_format(fmt).key_map_for(arch)
        kept = {
            name: eyas_key
            for name, eyas_key in invert_key_map(key_map).items()
            if name not in derivable or name in tensors
        }
        state = {eyas_key: tensors[name] for name, eyas_key in kept.items()}
        provenance = read_export_provenance(root) or {}
        ids = ids if ids is not None else _default_ids(root, fmt, provenance, num_target_layers)
        ckpt = DraftCheckpoint(root, arch, ids, str(provenance.get("target_fingerprint", "")), state)
    if embed_from is not None:
        ckpt.state["embed_tokens.weight"] = _read_embedding(Path(embed_from), ckpt)
    return producer, ckpt


def _load_tensors(weights: Path) -> dict[str, torch.Tensor]:
    if weights.name == BIN_FILE:
        return dict(torch.load(weights, map_location="cpu", weights_only=True, mmap=True))
    checked_safetensors_header(weights)
    return load_file(weights)


def _default_ids(root: Path, fmt: str, provenance: dict, num_target_layers: int | None) -> list[int]:
    if "aux_layer_ids" in provenance:
        return list(provenance["aux_layer_ids"])
    if num_target_layers is None:
        where = "fixed in the target's code" if fmt == "eagle" else "not in its config (the verifier's default)"
        raise ExportError(
            f"{root}: {fmt} format, whose layer ids are {where} ([2, N//2, N-3]); expected the target's layer "
            "count to name them: pass num_target_layers (eyas remap --num-target-layers N)"
        )
    return default_aux_layer_ids(num_target_layers)


def _read_embedding(path: Path, ckpt: DraftCheckpoint) -> torch.Tensor:
    expected = (ckpt.arch.target_vocab_size, ckpt.arch.hidden_size)
    checked_safetensors_header(path)
    with safe_open(path, framework="pt") as f:
        names = [k for k in EMBED_KEYS if k in f.keys()]
        if not names:
            raise ExportError(
                f"embed_from {path}: none of {list(EMBED_KEYS)}; expected the target's weights file that holds "
                "its input embedding (or an eyas checkpoint's model.safetensors)"
            )
        embed = f.get_tensor(names[0])
    if tuple(embed.shape) != expected:
        raise ExportError(
            f"embed_from {path}: {names[0]} has shape {list(embed.shape)}, expected {list(expected)} "
            "(target vocab x hidden size of the draft); it belongs to another target"
        )
    return embed


def load_exported_draft(
    export_dir: str | Path, target_embed: torch.Tensor, *, num_target_layers: int | None = None
) -> Eagle3Draft:
    """The draft as the engine runs it: the drafter's weights (key set checked strictly), embed from the target.

    The returned draft (float32, eval mode) carries `aux_layer_ids`: the canonical ids to capture.
    """
    root = Path(export_dir)
    _, ckpt = read_drafter(root, num_target_layers=num_target_layers)
    arch = ckpt.arch
    expected_embed = (arch.target_vocab_size, arch.hidden_size)
    if tuple(target_embed.shape) != expected_embed:
        raise ExportError(
            f"target embedding: shape {list(target_embed.shape)}, expected {list(expected_embed)} "
            f"(vocab_size x hidden_size of drafter {root}); the draft was trained for another target"
        )
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in ckpt.state.items()}
    state["embed_tokens.weight"] = target_embed.detach().float()
    check_vocab_mapping(state["d2t"], state["t2d"], f"drafter {root}", arch.draft_vocab_size)
    draft = Eagle3Draft(arch)
    draft.load_state_dict(state, strict=True)
    draft.freeze_embeddings()
    draft.eval()
    draft.aux_layer_ids = list(ckpt.aux_layer_ids)
    return draft
