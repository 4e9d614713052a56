"""The target LLM: its facts from config.json and weight headers, its fingerprint, loading, features.

Layer ids are indices into HF `outputs.hidden_states` (eyas/layer_ids.py). `hidden_states[-1]` of a
Llama model is taken after the final norm: it is the lm_head input ("last hidden state").
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from eyas.fsio import MAX_HEADER_BYTES, read_safetensors_header  # noqa: F401 -- re-exported

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name ("float32", "bfloat16", ...)."""
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


EMBED_KEY = "model.embed_tokens.weight"
# transformers' from_pretrained is not thread-safe: two model loads overlapping in two threads (extraction
# workers are threads) leave a tied lm_head on the meta device in most loads. One load at a time.
HF_LOAD_LOCK = threading.RLock()


def target_fingerprint(model_path: str | Path) -> str:
    """sha256 of config.json and every weight file's header (names, shapes, dtypes, offsets)."""
    root = Path(model_path)
    h = hashlib.sha256((root / "config.json").read_bytes())
    for weights in sorted(root.glob("*.safetensors")):
        h.update(weights.name.encode())
        h.update(json.dumps(read_safetensors_header(weights), sort_keys=True).encode())
    return h.hexdigest()[:16]


class TargetError(ValueError):
    """The target's directory cannot be read as eyas needs it."""


def read_target_config(target_path: str | Path) -> dict:
    """The target's config.json, read as JSON (no transformers, no remote code)."""
    path = Path(target_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"target {str(target_path)!r}: no config.json; expected a Hugging Face model directory")
    return json.loads(path.read_text())


def text_config(config: dict) -> dict:
    """The text model's part of a config: `text_config` of a multimodal wrapper (Kimi-K2.5), else the config."""
    return config.get("text_config") or config


def remote_code(config: dict) -> dict[str, str]:
    """The classes a config names in `auto_map` that transformers does not ship (they would run code from the
    model directory): {auto class: "module.Class"}; {} when transformers knows the model types."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    known = all(c.get("model_type") in CONFIG_MAPPING_NAMES for c in (config, text_config(config)))
    return {} if known else {k: str(v) for k, v in (config.get("auto_map") or {}).items()}


def check_remote_code(target_path: str | Path, trust_remote_code: bool) -> None:
    """Refuse to load a target whose model or tokenizer needs code from its directory, unless trusted."""
    config = read_target_config(target_path)
    needed = remote_code(config)
    if needed and not trust_remote_code:
        files = sorted({v.split(".")[0] + ".py" for v in needed.values() if "." in v and "--" not in v})
        raise TargetError(
            f"target {target_path}: model_type {config.get('model_type')!r} is not one transformers ships; loading "
            f"it runs code from the model directory ({', '.join(f'{k} -> {v}' for k, v in needed.items())}; files "
            f"{', '.join(files) or 'named in auto_map'}); expected target.trust_remote_code: true in the run config "
            "if you trust that code (the facts eyas reads from config.json and the weight headers need none)"
        )


def target_dims(target_path: str | Path) -> tuple[int, int]:
    """(num_layers, hidden_size) of the target's text model, from its config.json."""
    text = text_config(read_target_config(target_path))
    missing = [k for k in ("num_hidden_layers", "hidden_size") if not isinstance(text.get(k), int)]
    if missing:
        raise TargetError(f"target {target_path}: config.json has no integer {' or '.join(missing)} (nor text_config)")
    return int(text["num_hidden_layers"]), int(text["hidden_size"])


def find_weight(model_path: str | Path, suffix: str) -> tuple[Path, str, dict] | None:
    """(file, name, header entry) of the target's tensor ending in `suffix` (the text model's, not an MTP or
    vision copy), from the weight headers."""
    for weights in sorted(Path(model_path).glob("*.safetensors")):
        header = read_safetensors_header(weights)
        names = sorted((k for k in header if k.endswith(suffix) and "vision" not in k), key=len)
        if names:
            return weights, names[0], header[names[0]]
    return None


def embedding_rows(model_path: str | Path) -> int:
    """Rows of the target's input embedding (its vocab as the weights have it), from the weight headers."""
    found = find_weight(model_path, EMBED_KEY.removeprefix("model."))
    if found is None:
        raise KeyError(
            f"target {model_path}: no *embed_tokens.weight in its *.safetensors; expected a Llama-style checkpoint"
        )
    return int(found[2]["shape"][0])


class TargetFacts(BaseModel):
    """What every stage needs to know of the target, read from config.json and the weight headers only."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str
    num_layers: int
    hidden_size: int
    vocab_size: int  # rows of the input embedding
    fingerprint: str
    architectures: list[str] = []  # the config's (a wrapper's, for Kimi-K2.5)
    text_architectures: list[str] = []  # the text model's (text_config), or the same
    tie_word_embeddings: bool = False
    remote_code: dict[str, str] = {}  # auto_map classes transformers does not ship

    @classmethod
    def read(cls, model_path: str | Path) -> "TargetFacts":
        config = read_target_config(model_path)
        text = text_config(config)
        num_layers, hidden = target_dims(model_path)
        return cls(
            model_path=str(model_path),
            num_layers=num_layers,
            hidden_size=hidden,
            vocab_size=embedding_rows(model_path),
            fingerprint=target_fingerprint(model_path),
            architectures=list(config.get("architectures") or []),
            text_architectures=list(text.get("architectures") or config.get("architectures") or []),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            remote_code=remote_code(config),
        )

    def summary(self) -> dict:
        """The facts and what follows from them: default aux ids and each engine's numbering of them."""
        from eyas.layer_ids import default_aux_layer_ids, sglang_convention, to_engine_layer_ids

        ids = default_aux_layer_ids(self.num_layers)
        sglang = sglang_convention(self.architectures + self.text_architectures)
        return {
            **self.model_dump(),
            "default_aux_layer_ids": ids,
            "layer_numbering": {
                "hf_hidden_states": ids,
                sglang: to_engine_layer_ids(ids, sglang),
                "vllm": to_engine_layer_ids(ids, "vllm"),
            },
            "sglang_layer_numbering": sglang,
        }


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


def load_tokenizer(model_path: str | Path, *, trust_remote_code: bool = False):
    """The target's tokenizer (its code from the directory only with trust_remote_code)."""
    from transformers import AutoTokenizer

    check_remote_code(model_path, trust_remote_code)
    with HF_LOAD_LOCK:
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)


def load_target(model_path: str | Path, dtype: str = "float32", *, trust_remote_code: bool = False) -> Target:
    """The target through transformers (its code from the directory only with trust_remote_code)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"target.model_path={str(path)!r}: no config.json there; expected a Hugging Face model "
            f"directory (config.json, *.safetensors, tokenizer files)"
        )
    check_remote_code(path, trust_remote_code)
    with HF_LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code
        )
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
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
