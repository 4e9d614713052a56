"""The target LLM through Hugging Face transformers: loading, fingerprint, aux layer ids, features.

Layer ids everywhere in eyas are indices into HF `outputs.hidden_states`
(0 = embeddings, k = output of layer k-1 = input of layer k). `hidden_states[-1]` of a Llama
model is taken after the final norm: it is the lm_head input ("last hidden state").
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

LAYER_ID_CONVENTION = "hf_hidden_states"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default: inputs of layers 2, N//2 and N-3."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(configured: list[int] | None, num_layers: int) -> list[int]:
    ids = default_aux_layer_ids(num_layers) if configured is None else list(configured)
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(
            f"target.aux_layer_ids={ids}: expected distinct ids in 1..{num_layers - 1} "
            f"(HF hidden_states indices of a {num_layers}-layer target); found {bad or 'duplicates'}; "
            f"leave it unset for the default {default_aux_layer_ids(num_layers)}"
        )
    return ids


def read_safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def target_fingerprint(model_path: str | Path) -> str:
    """sha256 of config.json and every weight file's header (names, shapes, dtypes, offsets)."""
    root = Path(model_path)
    h = hashlib.sha256((root / "config.json").read_bytes())
    for weights in sorted(root.glob("*.safetensors")):
        h.update(weights.name.encode())
        h.update(json.dumps(read_safetensors_header(weights), sort_keys=True).encode())
    return h.hexdigest()[:16]


@dataclass
class Target:
    model: torch.nn.Module
    tokenizer: object
    path: Path

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id


# transformers' from_pretrained is not thread-safe: two model loads overlapping in two threads (extraction
# workers are threads) leave a tied lm_head on the meta device in most loads. One load at a time.
HF_LOAD_LOCK = threading.RLock()


def load_target(model_path: str | Path, dtype: str = "float32") -> Target:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"target.model_path={str(path)!r}: no config.json there; expected a Hugging Face model "
            f"directory (config.json, *.safetensors, tokenizer files)"
        )
    with HF_LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype))
        tokenizer = AutoTokenizer.from_pretrained(path)
    model.eval()
    return Target(model=model, tokenizer=tokenizer, path=path)


@torch.no_grad()
def target_features(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    aux_layer_ids: list[int],
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward pass: (aux [B,T,n_aux*H], last hidden [B,T,H], logits [B,T,V])."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    aux = torch.cat([hs[i] for i in aux_layer_ids], dim=-1)
    return aux, hs[-1], out.logits


def lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    return model.get_output_embeddings().weight


def embed_weight(model: torch.nn.Module) -> torch.Tensor:
    return model.get_input_embeddings().weight


def load_embed_and_lm_head(model_path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and lm_head [V, H] read from its safetensors, without transformers."""
    from safetensors import safe_open

    root = Path(model_path)
    config = json.loads((root / "config.json").read_text())
    found: dict[str, torch.Tensor] = {}
    wanted = {"model.embed_tokens.weight": "embed", "lm_head.weight": "lm_head"}
    for weights in sorted(root.glob("*.safetensors")):
        with safe_open(weights, framework="pt") as f:
            for key in wanted.keys() & set(f.keys()):
                found[wanted[key]] = f.get_tensor(key)
    if "embed" not in found:
        raise KeyError(
            f"target {root}: no model.embed_tokens.weight in its *.safetensors; expected a Llama-style checkpoint"
        )
    if "lm_head" not in found:
        if not config.get("tie_word_embeddings", False):
            raise KeyError(f"target {root}: no lm_head.weight and tie_word_embeddings is false in config.json")
        found["lm_head"] = found["embed"]
    return found["embed"], found["lm_head"]
