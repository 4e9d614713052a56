"""Drafter checkpoints as other tools write them (for tests/test_producers.py).

- `speculators_fixtures(version)`: built by the real speculators package, by scripts/build_speculators_fixtures.py
  under its kit (kits/speculators-VERSION.txt, installed by `make install`); cached in .kits/fixtures/ under the
  digest of the script and the lock file, so a change to either rebuilds them.
- `write_published(name, out)`: where the tool cannot run here, a checkpoint whose config.json and key names
  are copied from a published checkpoint or from the tool's own source (PUBLISHED cites each), with the
  sizes shrunk (SHRINK) and small random tensors. SpecForge's configs are its templates saved the way its
  exporter saves them (transformers' LlamaConfig.save_pretrained, then the top-level rope_theta copy of
  specforge/export/checkpoint_io.py apply_legacy_rope_scaling).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from eyas.draft_keys import LAYER_KEYS, TOP_KEYS

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from build_speculators_fixtures import option_fixtures  # noqa: E402

from kits import KITS, kit_env, lock_file  # noqa: E402

BUILD_SCRIPT = REPO / "scripts" / "build_speculators_fixtures.py"
SPECULATORS_VERSIONS = ("0.9.0", "0.8.1")  # 0.9.0: the newest on PyPI (2026-12-01); 0.8.1: the one before
# The fixtures with draft options, by name: the options each turns on.
OPTION_FIXTURES = {name: tuple(options) for name, options in option_fixtures().items() if options}

# Sizes of the shrunk copies (a Llama-3.1-8B draft is 4096 wide with a 128256 vocab).
SHRINK = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "draft_vocab_size": 128,
}
# The targets these drafts were published for, as their config.json says what eyas reads of them.
TARGETS = {
    "llama-3.1-8b": {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32},
    "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 48},
    "deepseek-v3": {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61},
    "kimi-k2": {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61},
}

_SPECFORGE = "sgl-project/SpecForge a6b6b023 (2026-08-08)"
_LLAMA3_TEMPLATE = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 1,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.28.1",
    "use_cache": True,
    "vocab_size": 128256,
    "draft_vocab_size": 32000,
}
# SpecForge (specforge/modeling/draft/llama3_eagle.py LlamaDecoderLayer, l.1570-1600), EAGLE
# (eagle/traineagle3/cnets.py LlamaDecoderLayeremb, l.372-385) and SGLang name the decoder layer's tensors
# as eyas does (eyas.draft_keys.LAYER_KEYS); only the prefix differs.


def _keys(prefix: str, *, embed: bool, fc_norm: bool = False) -> list[str]:
    keys = [f"{prefix}{k}" for k in LAYER_KEYS] + list(TOP_KEYS)
    keys += [f"fc_norm.{i}.weight" for i in range(3)] if fc_norm else []
    return keys + (["embed_tokens.weight"] if embed else [])


PUBLISHED: dict[str, dict] = {
    # SpecForge's exporter (specforge/export/to_sglang.py) saves the draft's state dict minus every key with
    # "embed" in it; the config is the training template (configs/*.json) through LlamaConfig.
    "specforge-llama3.1-8b": {
        "source": f"{_SPECFORGE}: configs/llama3-8B-eagle3.json, specforge/export/to_sglang.py",
        "config": _LLAMA3_TEMPLATE,
        "save": "specforge",
        "keys": _keys("midlayer.", embed=False),
        "weights": "model.safetensors",
        "target": "llama-3.1-8b",
    },
    "specforge-deepseek-v3": {
        "source": f"{_SPECFORGE}: configs/deepseek-v3-671b-eagle3.json",
        "config": {
            "architectures": ["LlamaForCausalLMEagle3"],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True},
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "hidden_act": "silu",
            "hidden_size": 7168,
            "initializer_range": 0.02,
            "intermediate_size": 40960,
            "max_position_embeddings": 163840,
            "model_type": "llama",
            "num_attention_heads": 56,
            "num_key_value_heads": 8,
            "num_hidden_layers": 1,
            "pad_token_id": 0,
            "rms_norm_eps": 1e-05,
            "tie_word_embeddings": False,
            "torch_dtype": "float16",
            "transformers_version": "4.51.0",
            "use_cache": True,
            "vocab_size": 129280,
            "draft_vocab_size": 32000,
        },
        "save": "specforge",
        "keys": _keys("midlayer.", embed=False),
        "weights": "model.safetensors",
        "target": "deepseek-v3",
    },
    # EAGLE 3.1 in SpecForge (commit b7ce50cd): fc_norm builds 3 RMSNorms before fc; its norm_output (default
    # true) is the final norm before lm_head, and the pre-norm state is fed back (llama3_eagle.py l.1690, 1772).
    "specforge-qwen3-30b-a3b-eagle3.1": {
        "source": f"{_SPECFORGE}: configs/qwen3-30B-A3B-eagle3.1.json",
        "config": {
            "architectures": ["LlamaForCausalLMEagle3"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "fc_norm": True,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 12288,
            "max_position_embeddings": 2048,
            "max_window_layers": 48,
            "model_type": "llama",
            "norm_output": True,
            "num_attention_heads": 32,
            "num_hidden_layers": 1,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.53.2",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
            "draft_vocab_size": 32000,
        },
        "save": "specforge",
        "keys": _keys("midlayer.", embed=False, fc_norm=True),
        "weights": "model.safetensors",
        "target": "qwen3-30b-a3b",
    },
    # EAGLE's trainer saves with deepspeed save_16bit_model(exclude_frozen_parameters=True) (main.py l.349):
    # pytorch_model.bin in float16 without the frozen embedding (850 MB published = fc + layer + lm_head).
    "eagle-official-llama3.1-8b": {
        "source": "SafeAILab/EAGLE cb7e0841: eagle/traineagle3/config.json (591 B, as published in "
        "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B), eagle/traineagle3/cnets.py Model",
        "config": {**_LLAMA3_TEMPLATE, "architectures": ["LlamaForCausalLM"]},
        "save": "verbatim",
        "keys": _keys("midlayer.", embed=False),
        "weights": "pytorch_model.bin",
        "target": "llama-3.1-8b",
    },
    "aq-medai-kimi-k2": {
        "source": "https://huggingface.co/AQ-MedAI/Kimi-K2-Instruct-eagle3/blob/main/config.json (key names not "
        "published: those of SGLang's LlamaForCausalLMEagle3, which its architectures select)",
        "config": {
            "architectures": ["LlamaForCausalLMEagle3"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 163584,
            "draft_vocab_size": 32000,
            "dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True},
            "eos_token_id": 163585,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 7168,
            "initializer_range": 0.02,
            "intermediate_size": 18432,
            "max_position_embeddings": 131072,
            "max_window_layers": 48,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 64,
            "num_hidden_layers": 1,
            "num_key_value_heads": 64,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "transformers_version": "4.57.0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 163840,
        },
        "save": "verbatim",
        "keys": _keys("midlayer.", embed=False),
        "weights": "model.safetensors",
        "target": "kimi-k2",
    },
    # `speculators convert` of the EAGLE official draft: layers.0.*, no embed_tokens (the source had none).
    "speculators-0.1.0.dev14-converted": {
        "source": "https://huggingface.co/nm-testing/EAGLE3-LLaMA3.1-Instruct-8B-converted/blob/main/config.json",
        "config": {
            "architectures": ["Eagle3Speculator"],
            "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
            "draft_vocab_size": 32000,
            "has_no_defaults_at_init": False,
            "norm_before_residual": False,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {
                        "accept_tolerance": 0.0,
                        "proposal_type": "greedy",
                        "speculative_tokens": 5,
                        "verifier_accept_k": 1,
                    }
                ],
                "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "meta-llama/Llama-3.1-8B-Instruct"},
            },
            "speculators_model_type": "eagle3",
            "speculators_version": "0.1.0.dev14",
            "target_hidden_size": None,
            "torch_dtype": "float32",
            "transformer_layer_config": {
                "attention_bias": False,
                "attention_dropout": 0.0,
                "head_dim": 128,
                "hidden_act": "silu",
                "hidden_size": 4096,
                "initializer_range": 0.02,
                "intermediate_size": 14336,
                "max_position_embeddings": 2048,
                "mlp_bias": False,
                "model_type": "llama",
                "num_attention_heads": 32,
                "num_hidden_layers": 1,
                "num_key_value_heads": 8,
                "pretraining_tp": 1,
                "rms_norm_eps": 1e-05,
                "rope_scaling": None,
                "rope_theta": 10000.0,
                "use_cache": True,
                "vocab_size": 128256,
            },
            "transformers_version": "4.53.2",
        },
        "save": "verbatim",
        "keys": _keys("layers.0.", embed=False),
        "weights": "model.safetensors",
        "target": "llama-3.1-8b",
    },
}


def shrink(config: dict) -> dict:
    """The config with its sizes replaced by SHRINK's (nested decoder configs too)."""
    out = {k: (SHRINK[k] if k in SHRINK and isinstance(v, int) else v) for k, v in config.items()}
    if isinstance(out.get("transformer_layer_config"), dict):
        out["transformer_layer_config"] = shrink(out["transformer_layer_config"])
    return out


def _shapes(config: dict, keys: list[str]) -> dict[str, tuple[int, ...]]:
    """The tensor shapes of a Llama EAGLE-3 draft (the producers' module definitions cited in PUBLISHED)."""
    layer = config.get("transformer_layer_config") or config
    h, inter, vocab = layer["hidden_size"], layer["intermediate_size"], layer["vocab_size"]
    heads, kv = layer["num_attention_heads"], layer["num_key_value_heads"]
    hd = layer.get("head_dim") or h // heads
    draft = config["draft_vocab_size"]
    by_suffix = {
        "hidden_norm.weight": (h,),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (heads * hd, 2 * h),
        "self_attn.k_proj.weight": (kv * hd, 2 * h),
        "self_attn.v_proj.weight": (kv * hd, 2 * h),
        "self_attn.o_proj.weight": (h, heads * hd),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    top = {
        "fc.weight": (h, 3 * h),
        "norm.weight": (h,),
        "lm_head.weight": (draft, h),
        "d2t": (draft,),
        "t2d": (vocab,),
        "embed_tokens.weight": (vocab, h),
    }
    shapes = {}
    for key in keys:
        if key in top:
            shapes[key] = top[key]
        elif key.startswith("fc_norm."):
            shapes[key] = (h,)
        else:
            shapes[key] = by_suffix[key.removeprefix("midlayer.").removeprefix("layers.0.")]
    return shapes


def random_tensors(config: dict, keys: list[str], dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Small random tensors of the draft's shapes: norms 1 + 0.1 N(0, 1), a consistent d2t/t2d (offsets)."""
    g = torch.Generator().manual_seed(seed)
    shapes = _shapes(config, keys)
    out = {}
    for key, shape in shapes.items():
        if key in ("d2t", "t2d"):
            continue
        t = torch.randn(shape, generator=g)
        out[key] = (1 + 0.1 * t if "norm" in key else 0.05 * t).to(dtype)
    if "d2t" in shapes:
        vocab, draft = shapes["t2d"][0], shapes["d2t"][0]
        ids = torch.sort(torch.randperm(vocab, generator=g)[:draft]).values
        out["d2t"] = ids - torch.arange(draft)
        out["t2d"] = torch.zeros(vocab, dtype=torch.bool)
        out["t2d"][ids] = True
    return out


def _specforge_config(template: dict, out: Path) -> None:
    """The config as SpecForge's exporter writes it: LlamaConfig.save_pretrained, then rope_theta copied to the
    top level when rope_parameters carries it (apply_legacy_rope_scaling)."""
    from transformers import LlamaConfig

    LlamaConfig(**template).save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and config.get("rope_theta") != theta:
        config["rope_theta"] = theta
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_published(name: str, out: Path) -> Path:
    """The shrunk copy of PUBLISHED[name] in `out`; returns `out`."""
    entry = PUBLISHED[name]
    out.mkdir(parents=True, exist_ok=True)
    config = shrink(entry["config"])
    if entry["save"] == "specforge":
        _specforge_config(config, out)
    else:
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    dtype_name = config.get("torch_dtype") or config.get("dtype") or "float32"
    tensors = random_tensors(config, entry["keys"], getattr(torch, dtype_name))
    if entry["weights"] == "pytorch_model.bin":
        torch.save(tensors, out / "pytorch_model.bin")
    else:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_target(name: str, out: Path) -> Path:
    """The parts of a target's config.json eyas reads (architectures, layer count) in `out/config.json`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(TARGETS[name]))
    return out


def _digest(version: str) -> str:
    h = hashlib.sha256(BUILD_SCRIPT.read_bytes())
    h.update(lock_file(f"speculators-{version}").read_bytes())
    return h.hexdigest()[:16]


def speculators_fixtures(version: str) -> Path:
    """The fixtures the real speculators `version` builds (scripts/build_speculators_fixtures.py), built once."""
    out = KITS / "fixtures" / f"speculators-{version}-{_digest(version)}"
    if (out / "manifest.json").is_file():
        return out
    temp = out.with_name(out.name + ".partial")
    shutil.rmtree(temp, ignore_errors=True)
    cmd = [sys.executable, str(BUILD_SCRIPT), "build", "--out", str(temp), "--version", version]
    result = subprocess.run(cmd, env=kit_env(f"speculators-{version}"), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"building the speculators {version} fixtures failed:\n{result.stderr[-4000:]}"
    temp.rename(out)
    return out


def speculators_forward(version: str, checkpoint: Path, inputs: Path, out: Path) -> Path:
    """speculators' own forward (the kit's package) on `checkpoint` for the inputs in `inputs`; logits in `out`."""
    cmd = [sys.executable, str(BUILD_SCRIPT), "forward", "--checkpoint", str(checkpoint), "--inputs", str(inputs)]
    result = subprocess.run(
        [*cmd, "--out", str(out)], env=kit_env(f"speculators-{version}"), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"speculators' forward on {checkpoint} failed:\n{result.stderr[-4000:]}"
    return out
