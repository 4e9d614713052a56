"""The target LLM: its facts from config.json and weight headers, its fingerprint, loading, features.

Layer ids are indices into HF `outputs.hidden_states` (eyas/layer_ids.py). `hidden_states[-1]` of a
Llama model is taken after the final norm: it is the lm_head input ("last hidden state").
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name ("float32", "bfloat16", ...)."""
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own bound on a header
EMBED_KEY = "model.embed_tokens.weight"
# transformers' from_pretrained is not thread-safe: two model loads overlapping in two threads (extraction
# workers are threads) leave a tied lm_head on the meta device in most loads. One load at a time.
HF_LOAD_LOCK = threading.RLock()


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (names, dtypes, shapes, byte offsets), its length bounded."""
    with open(path, "rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        file_size = os.fstat(f.fileno()).st_size
        if not 2 <= size <= min(MAX_HEADER_BYTES, file_size - 8):
            raise ValueError(
                f"{path}: not a safetensors file (header length {size}, file size {file_size} bytes); "
                "expected the weights of a Hugging Face model directory"
            )
        return json.loads(f.read(size))


def target_fingerprint(model_path: str | Path) -> str:
    """sha256 of config.json and every weight file's header (names, shapes, dtypes, offsets)."""
    root = Path(model_path)
    h = hashlib.sha256((root / "config.json").read_bytes())
    for weights in sorted(root.glob("*.safetensors")):
        h.update(weights.name.encode())
        h.update(json.dumps(read_safetensors_header(weights), sort_keys=True).encode())
    return h.hexdigest()[:16]


def target_dims(target_path: str | Path) -> tuple[int, int]:
    """(num_layers, hidden_size) from the target's config.json, without loading its weights."""
    from transformers import AutoConfig

    path = Path(target_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target {str(path)!r}: no config.json; expected a Hugging Face model directory")
    with HF_LOAD_LOCK:
        cfg = AutoConfig.from_pretrained(path).get_text_config()
    return int(cfg.num_hidden_layers), int(cfg.hidden_size)


def embedding_rows(model_path: str | Path) -> int:
    """Rows of the target's input embedding (its vocab as the weights have it), from the weight headers."""
    root = Path(model_path)
    for weights in sorted(root.glob("*.safetensors")):
        entry = read_safetensors_header(weights).get(EMBED_KEY)
        if entry is not None:
            return int(entry["shape"][0])
    raise KeyError(f"target {root}: no {EMBED_KEY} in its *.safetensors; expected a Llama-style checkpoint")


class TargetFacts(BaseModel):
    """What every stage needs to know of the target, read from config.json and the weight headers only."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str
    num_layers: int
    hidden_size: int
    vocab_size: int  # rows of the input embedding
    fingerprint: str

    @classmethod
    def read(cls, model_path: str | Path) -> "TargetFacts":
        num_layers, hidden = target_dims(model_path)
        return cls(
            model_path=str(model_path),
            num_layers=num_layers,
            hidden_size=hidden,
            vocab_size=embedding_rows(model_path),
            fingerprint=target_fingerprint(model_path),
        )


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
