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
from eyas.target_check import config_shape_problem

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


def read_tokenizer_config(target_path: str | Path) -> dict:
    """The target's tokenizer_config.json, read as JSON; {} when there is none."""
    path = Path(target_path) / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def native_config(config: dict):
    """The config as transformers' own class of its model_type builds it (no remote code), or None when
    transformers does not ship that model_type. A wrapper's class builds its text config: Kimi-K2.5's
    `kimi_k25` class reads a `kimi_k2` text_config as `deepseek_v3`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING_NAMES:
        return None
    cls = CONFIG_MAPPING[model_type]
    try:
        return cls.from_dict(config)
    except (TypeError, ValueError) as err:
        raise TargetError(
            f"config.json (model_type {model_type!r}): transformers' {cls.__name__} refuses it ({err}); expected "
            "the config the model was published with"
        ) from err


def _native_text_config(config: dict):
    """The text model's config as transformers' own classes build it, or None when it does not ship them."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    native = native_config(config)
    if native is None:
        return None
    text = native.get_text_config()
    return text if text.model_type in CONFIG_MAPPING_NAMES else None


def _tokenizer_remote_code(tokenizer_config: dict) -> dict[str, str]:
    """{"AutoTokenizer": "module.Class"} when tokenizer_config.json names a class of its own in `auto_map` that
    transformers does not ship (Kimi's tokenization_kimi.TikTokenTokenizer), else {}."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    entry = (tokenizer_config.get("auto_map") or {}).get("AutoTokenizer")
    classes = [c for c in (entry if isinstance(entry, list) else [entry]) if c]
    shipped = tokenizer_config.get("tokenizer_class")
    if not classes or (shipped and tokenizer_class_from_name(shipped) is not None):
        return {}
    return {"AutoTokenizer": str(classes[0])}


def remote_code(config: dict, tokenizer_config: dict | None = None) -> dict[str, str]:
    """The classes the target names in `auto_map` that transformers does not ship (they would run code from the
    model directory): {auto class: "module.Class"}. The model's count only when transformers has no class of
    its own for the config or its text config (it ships `kimi_k25` and DeepSeek-V3); the tokenizer's when
    tokenizer_config.json names a tokenizer_class transformers lacks."""
    needed = {} if _native_text_config(config) is not None else dict(config.get("auto_map") or {})
    needed = {k: str(v) for k, v in needed.items()}
    return {**needed, **_tokenizer_remote_code(tokenizer_config or {})}


def check_remote_code(target_path: str | Path, trust_remote_code: bool) -> None:
    """Refuse to load a target whose model or tokenizer needs code from its directory, unless trusted."""
    config = read_target_config(target_path)
    tokenizer = read_tokenizer_config(target_path)
    needed = remote_code(config, tokenizer)
    if needed and not trust_remote_code:
        files = sorted({v.split(".")[0] + ".py" for v in needed.values() if "." in v and "--" not in v})
        parts = [f"its tokenizer_class {tokenizer.get('tokenizer_class')!r}"] if "AutoTokenizer" in needed else []
        if set(needed) - {"AutoTokenizer"}:
            parts.insert(0, f"model_type {config.get('model_type')!r}")
        raise TargetError(
            f"target {target_path}: {' and '.join(parts)} {'are not ones' if len(parts) > 1 else 'is not one'} "
            "transformers ships; loading it runs code from "
            f"the model directory ({', '.join(f'{k} -> {v}' for k, v in needed.items())}; files "
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
    vision copy: the shortest such name over every weight file), from the weight headers."""
    found = []
    for weights in sorted(Path(model_path).glob("*.safetensors")):
        header = read_safetensors_header(weights)
        found += [(len(k), k, weights, header[k]) for k in header if k.endswith(suffix) and "vision" not in k]
    if not found:
        return None
    _, name, weights, entry = min(found, key=lambda f: f[:2])
    return weights, name, entry


def text_weight_prefix(model_path: str | Path) -> str:
    """Where the text model's weights sit in the checkpoint: "" for a causal LM (`model.embed_tokens.weight`),
    "language_model." for Kimi-K2.5's wrapper (SGLang strips it the same way), read from the weight headers."""
    found = find_weight(model_path, EMBED_KEY.removeprefix("model."))
    if found is None:
        raise TargetError(
            f"target {model_path}: no *embed_tokens.weight in its *.safetensors; expected a Llama-style checkpoint "
            "(model.embed_tokens.weight) or a wrapper's (language_model.model.embed_tokens.weight)"
        )
    if not found[1].endswith(EMBED_KEY):
        raise TargetError(
            f"target {model_path}: input embedding {found[1]!r} in {found[0].name}; expected PREFIX{EMBED_KEY} "
            "(the text model's weights under the wrapper's prefix)"
        )
    return found[1].removesuffix(EMBED_KEY)


def embedding_rows(model_path: str | Path) -> int:
    """Rows of the target's input embedding (its vocab as the weights have it), from the weight headers."""
    found = find_weight(model_path, EMBED_KEY.removeprefix("model."))
    if found is None:
        raise KeyError(
            f"target {model_path}: no *embed_tokens.weight in its *.safetensors; expected a Llama-style checkpoint"
        )
    return int(found[2]["shape"][0])


def ties_embeddings(config: dict) -> bool:
    """Whether the text model's lm_head is its input embedding (the text config's flag, else the wrapper's)."""
    return bool(text_config(config).get("tie_word_embeddings", config.get("tie_word_embeddings", False)))


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
    remote_code: dict[str, str] = {}  # auto_map classes (model, tokenizer) transformers does not ship

    @classmethod
    def read(cls, model_path: str | Path) -> "TargetFacts":
        """The facts, once config.json is checked against the weight headers (eyas.target_check)."""
        config = read_target_config(model_path)
        text = text_config(config)
        num_layers, hidden = target_dims(model_path)
        problem = config_shape_problem(model_path, config, text_weight_prefix(model_path))
        if problem is not None:
            raise TargetError(problem)
        return cls(
            model_path=str(model_path),
            num_layers=num_layers,
            hidden_size=hidden,
            vocab_size=embedding_rows(model_path),
            fingerprint=target_fingerprint(model_path),
            architectures=list(config.get("architectures") or []),
            text_architectures=list(text.get("architectures") or config.get("architectures") or []),
            tie_word_embeddings=ties_embeddings(config),
            remote_code=remote_code(config, read_tokenizer_config(model_path)),
        )

    def summary(self) -> dict:
        """The facts and what follows from them: default aux ids and each engine's numbering of them."""
        from eyas.layer_ids import SGLangTargetError, default_aux_layer_ids, sglang_convention, to_engine_layer_ids

        ids = default_aux_layer_ids(self.num_layers)
        numbering = {"hf_hidden_states": ids, "vllm": to_engine_layer_ids(ids, "vllm")}
        try:
            sglang = sglang_convention(self.architectures + self.text_architectures)
        except SGLangTargetError as err:  # a target SGLang cannot serve with EAGLE-3: the hf backend still can
            return {**self.model_dump(), "default_aux_layer_ids": ids, "layer_numbering": numbering,
                    "sglang_layer_numbering": None, "sglang_refuses": str(err)}  # fmt: skip
        return {
            **self.model_dump(),
            "default_aux_layer_ids": ids,
            "layer_numbering": {**numbering, sglang: to_engine_layer_ids(ids, sglang)},
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
    """The target's model (load_target_model) and tokenizer (its code from the directory only with
    trust_remote_code)."""
    from transformers import AutoTokenizer

    model = load_target_model(model_path, dtype, trust_remote_code=trust_remote_code)
    with HF_LOAD_LOCK:
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    return Target(model=model, tokenizer=tokenizer, path=Path(model_path))


def load_target_model(model_path: str | Path, dtype: str = "float32", *, trust_remote_code: bool = False):
    """The target's causal LM in eval mode. A multimodal wrapper whose text model's weights sit under a prefix
    (Kimi-K2.5: DeepseekV3ForCausalLM under `language_model.`) runs as that text model through transformers'
    own classes (load_text_model); anything else through AutoModelForCausalLM, with code from the
    directory only with trust_remote_code. float64 runs MoE experts eagerly (the grouped kernels lack it)."""
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"target.model_path={str(path)!r}: no config.json there; expected a Hugging Face model "
            f"directory (config.json, *.safetensors, tokenizer files)"
        )
    check_remote_code(path, trust_remote_code)
    config = read_target_config(path)
    kwargs = {"dtype": torch_dtype(dtype), **({"experts_implementation": "eager"} if dtype == "float64" else {})}
    text = _native_text_config(config) if "text_config" in config else None
    prefix = text_weight_prefix(path) if text is not None else ""
    with HF_LOAD_LOCK:
        if prefix:
            model = load_text_model(path, text, prefix, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    return model.eval()


def load_text_model(path: Path, text, prefix: str, **kwargs) -> torch.nn.Module:
    """A wrapper's text model: transformers' own causal-LM class of the text config `text` (DeepseekV3ForCausalLM
    for Kimi-K2.5), its weights the checkpoint's `prefix`* tensors with the prefix stripped, as SGLang's
    KimiK25ForConditionalGeneration.load_weights hands them to its language model; the vision tower and the
    projector are not loaded. Every text weight must load and every parameter must get one."""
    import logging
    import re

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(text), None)
    if cls is None:
        raise TargetError(
            f"target {path}: text model_type {text.model_type!r} has no causal-LM class in transformers; expected "
            "a wrapper around a text model transformers runs (Kimi-K2.5's DeepSeek-V3)"
        )
    # transformers' load report calls the vision tensors unexpected: the checks below replace it, and it is kept
    # for the error when transformers itself refuses the weights
    reports: list[str] = []

    def keep(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" not in str(record.msg):
            return True
        reports.append(record.getMessage())
        return False

    log = logging.getLogger("transformers.modeling_utils")
    log.addFilter(keep)
    try:
        model, info = cls.from_pretrained(
            path, config=text, key_mapping={f"^{re.escape(prefix)}": ""}, output_loading_info=True, **kwargs
        )
    except RuntimeError as err:
        lines = [" ".join(line.split()) for r in reports for line in re.sub(r"\x1b\[[0-9;]*m", "", r).splitlines()]
        found = [line.rstrip(" |") for line in lines if re.search(r"\| (MISSING|MISMATCH|CONVERSION)|^Error:", line)]
        raise TargetError(
            f"target {path}: transformers refuses the weights under {prefix!r} for its text model {cls.__name__} "
            f"({'; '.join(found) or err}); expected the checkpoint config.json describes"
        ) from err
    finally:
        log.removeFilter(keep)
    names = {n for w in sorted(path.glob("*.safetensors")) for n in read_safetensors_header(w)}
    untaken = sorted(prefix + k for k in info["unexpected_keys"] if prefix + k in names)
    problems = [f"{len(v)} {what}: {', '.join(v[:8])}" for what, v in (
        ("parameters of the text model found no weight", sorted(info["missing_keys"])),
        (f"weights under {prefix!r} the text model does not take", untaken),
        ("weights of another shape", sorted(map(str, info["mismatched_keys"]))),
    ) if v]  # fmt: skip
    if problems:
        raise TargetError(
            f"target {path}: its text model {cls.__name__} under {prefix!r} does not match the weights ("
            f"{'; '.join(problems)}); expected the checkpoint config.json describes"
        )
    return model


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
    """The target's input embedding and lm_head [V, H] read from its safetensors, without transformers: under the
    wrapper's prefix for a wrapper (Kimi-K2.5's `language_model.model.embed_tokens.weight`)."""
    from safetensors import safe_open

    root = Path(model_path)
    config = read_target_config(root)
    prefix = text_weight_prefix(root)
    wanted = {"embed": prefix + EMBED_KEY, "lm_head": prefix + "lm_head.weight"}
    found: dict[str, torch.Tensor] = {}
    for weights in sorted(root.glob("*.safetensors")):
        names = set(read_safetensors_header(weights))
        with safe_open(weights, framework="pt") as f:
            found |= {what: f.get_tensor(key) for what, key in wanted.items() if key in names}
    if "lm_head" not in found:
        if not ties_embeddings(config):
            raise KeyError(
                f"target {root}: no {wanted['lm_head']} in its *.safetensors and tie_word_embeddings is false in "
                "config.json; expected the text model's lm_head beside its embedding"
            )
        found["lm_head"] = found["embed"]
    return found["embed"], found["lm_head"]
