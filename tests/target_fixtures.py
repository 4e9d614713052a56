"""Config-only targets shaped like the large ones eyas is for, with weight headers and no weights.

    kimi = write_target(tmp_path / "kimi-k2.5", "kimi-k2.5")     # KimiK25ForConditionalGeneration wrapper
    dsv3 = write_target(tmp_path / "deepseek-v3", "deepseek-v3")

config.json follows the published configs' shape (moonshotai/Kimi-K2.5: a `kimi_k25` wrapper with `auto_map`,
a `kimi_k2` / DeepseekV3ForCausalLM `text_config`, a `vision_config`; deepseek-ai/DeepSeek-V3: `deepseek_v3`
with `auto_map` for its own modeling file, which transformers also ships), trimmed to the fields eyas and
SGLang's argument code read. The weights are safetensors headers only: the tensors' names, dtypes and shapes
as the checkpoints have them (the embedding, the lm_head, a layer's norm), with no data after the header,
which is all eyas reads of a target's weights outside extraction (facts, fingerprint). Kimi-K2.5's
tokenizer_config.json names its own tokenizer class (tokenization_kimi.TikTokenTokenizer, which transformers
does not ship), as the published one does.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

DEEPSEEK_V3_TEXT = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "tie_word_embeddings": False, "num_nextn_predict_layers": 1, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "hidden_act": "silu", "torch_dtype": "bfloat16",
}  # fmt: skip

CONFIGS = {
    "deepseek-v3": {
        **DEEPSEEK_V3_TEXT,
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                     "AutoModel": "modeling_deepseek.DeepseekV3Model",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    },
    "kimi-k2.5": {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "model_type": "kimi_k25",
        "media_placeholder_token_id": 163605,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "text_config": {**DEEPSEEK_V3_TEXT, "model_type": "kimi_k2", "vocab_size": 163840, "rope_theta": 50000.0,
                        "max_position_embeddings": 262144, "bos_token_id": 163584, "eos_token_id": 163585},
        "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 14, "vt_hidden_size": 1152,
                          "vt_num_hidden_layers": 27, "mm_hidden_size": 1152, "text_hidden_size": 7168},
    },
}  # fmt: skip

# name, dtype, shape of the tensors each header lists (the checkpoints' names)
TENSORS = {
    "deepseek-v3": [
        ("model.embed_tokens.weight", "BF16", [129280, 7168]),
        ("lm_head.weight", "BF16", [129280, 7168]),
        ("model.layers.0.input_layernorm.weight", "BF16", [7168]),
        ("model.layers.61.embed_tokens.weight", "BF16", [129280, 7168]),  # the MTP layer's copy
    ],
    "kimi-k2.5": [
        ("language_model.model.embed_tokens.weight", "BF16", [163840, 7168]),
        ("language_model.lm_head.weight", "BF16", [163840, 7168]),
        ("language_model.model.layers.0.input_layernorm.weight", "BF16", [7168]),
        ("vision_tower.encoder.blocks.0.norm0.weight", "BF16", [1152]),
    ],
}
TOKENIZER_CONFIGS = {
    "kimi-k2.5": {"tokenizer_class": "TikTokenTokenizer",
                  "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}},
}  # fmt: skip
_BYTES = {"BF16": 2, "F32": 4}


def write_header_only(path: Path, tensors: list[tuple[str, str, list[int]]]) -> None:
    """A safetensors file that is its header: names, dtypes, shapes and offsets, no tensor data."""
    header, offset = {}, 0
    for name, dtype, shape in tensors:
        size = _BYTES[dtype]
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, sort_keys=True).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)


def write_target(out: Path, name: str) -> Path:
    """The config-only target `name` ("kimi-k2.5" or "deepseek-v3") in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(CONFIGS[name], indent=1))
    write_header_only(out / "model-00001-of-00001.safetensors", TENSORS[name])
    if name in TOKENIZER_CONFIGS:
        (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIGS[name], indent=1))
    return out
