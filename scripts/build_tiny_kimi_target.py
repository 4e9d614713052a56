"""Build the tiny Kimi target: a Kimi-K2.5-shaped checkpoint at toy width, trained on Python's own stdlib source.

Usage: python scripts/build_tiny_kimi_target.py [--out fixtures/tiny-kimi-target] [--steps 400]

Kimi-K2.5 is a `kimi_k25` multimodal wrapper (KimiK25ForConditionalGeneration) around a DeepSeek-V3-style
text model (MLA attention, MoE MLP with a shared expert and sigmoid, group-limited routing, yarn rope), its
weights under `language_model.` beside the vision tower's and the projector's. This fixture keeps that shape:
config.json has the wrapper's keys as Kimi-K2.5's has them (architectures, auto_map, model_type kimi_k25, a
`kimi_k2` text_config with the DeepSeek-V3 keys, a vision_config), model.safetensors holds the text model's
tensors under `language_model.` with one tensor per expert as the published checkpoint has them, and a few
vision and projector tensors. No modeling code ships with it: transformers' own classes run the text model.

The text model is transformers' DeepseekV3ForCausalLM, trained like the tiny Llama target
(scripts/build_tiny_target.py: the same stdlib split, the same tokenizer, read from --tokenizer-from) so its
predictions are peaked enough for a drafter to learn. Deterministic with the same Python and torch (fixed
seed, deterministic algorithms, eager experts). Writes config.json, generation_config.json,
model.safetensors (bfloat16, as Kimi's), the tokenizer files, prompts.jsonl and heldout_prompts.jsonl (the
first prompts of the tiny target's sets) and build.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from build_tiny_target import SEQ_LEN, encode_corpus, perplexity, read_text, stdlib_files, train
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

PREFIX = "language_model."  # where Kimi-K2.5 keeps its text model's weights
VOCAB_SIZE, HIDDEN, VISION_HIDDEN = 2048, 128, 32
TEXT_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": VOCAB_SIZE,
    "hidden_size": HIDDEN, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 8,
    "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-06, "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 1.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 0, "eos_token_id": 0, "attention_bias": False, "initializer_range": 0.02, "use_cache": True,
}  # fmt: skip
CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                 "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                 "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
    "model_type": "kimi_k25", "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "ignore_index": -100,
    "media_placeholder_token_id": VOCAB_SIZE - 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_unified_vision_chunk": True, "text_config": TEXT_CONFIG,
    "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 14, "init_pos_emb_height": 4,
                      "init_pos_emb_width": 4, "merge_kernel_size": [2, 2], "vt_hidden_size": VISION_HIDDEN,
                      "vt_intermediate_size": 64, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1,
                      "mm_hidden_size": VISION_HIDDEN, "mm_projector_type": "patchmerger",
                      "text_hidden_size": HIDDEN},
}  # fmt: skip
# a few of the vision tower's and the projector's tensors, named as Kimi-K2.5's checkpoint names them
VISION_TENSORS = {
    "vision_tower.patch_embed.proj.weight": [VISION_HIDDEN, 3, 14, 14],
    "vision_tower.patch_embed.pos_emb.weight": [4, 4, VISION_HIDDEN],
    "vision_tower.encoder.blocks.0.norm0.weight": [VISION_HIDDEN],
    "vision_tower.encoder.blocks.0.wqkv.weight": [3 * VISION_HIDDEN, VISION_HIDDEN],
    "vision_tower.encoder.blocks.0.wo.weight": [VISION_HIDDEN, VISION_HIDDEN],
    "mm_projector.pre_norm.weight": [VISION_HIDDEN],
    "mm_projector.proj.0.weight": [4 * VISION_HIDDEN, 4 * VISION_HIDDEN],
    "mm_projector.proj.2.weight": [HIDDEN, 4 * VISION_HIDDEN],
}


def make_text_model() -> DeepseekV3ForCausalLM:
    text = copy.deepcopy(TEXT_CONFIG)  # the config class fills in rope_scaling: config.json keeps Kimi's keys
    config = DeepseekV3Config(**{k: v for k, v in text.items() if k not in ("architectures", "model_type")})
    config._experts_implementation = "eager"  # grouped kernels are not deterministic on every backend
    return DeepseekV3ForCausalLM(config)


def checkpoint_tensors(model: DeepseekV3ForCausalLM) -> dict[str, torch.Tensor]:
    """The text model's tensors as the published checkpoint names them (save_pretrained undoes transformers'
    fused experts: one gate/up/down per expert) under PREFIX, in bfloat16, and the vision tensors."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        text = {}
        for weights in sorted(Path(tmp).glob("*.safetensors")):
            text |= load_file(weights)
    tensors = {PREFIX + name: t.to(torch.bfloat16).contiguous() for name, t in text.items()}
    gen = torch.Generator().manual_seed(1)
    for name, shape in VISION_TENSORS.items():
        tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    return dict(sorted(tensors.items()))


def copy_prompts(source: Path, out: Path, count: int) -> None:
    lines = source.read_text().splitlines(keepends=True)
    if len(lines) < count:
        raise SystemExit(f"{source}: {len(lines)} prompts, expected at least {count}")
    out.write_text("".join(lines[:count]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fixtures/tiny-kimi-target")
    parser.add_argument("--tokenizer-from", default="fixtures/tiny-target", help="the tiny target's directory")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--num-train-prompts", type=int, default=96)
    parser.add_argument("--num-heldout-prompts", type=int, default=16)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # tiny ops: one thread is faster, and the same on every machine
    source, out = Path(args.tokenizer_from), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    train_files, held_files = stdlib_files()
    train_ids = encode_corpus(tok, [read_text(f) for f in train_files])
    held_ids = encode_corpus(tok, [read_text(f) for f in held_files])
    model = make_text_model()
    num_params = sum(p.numel() for p in model.parameters())
    print(f"tokens: train {train_ids.numel():,}  held-out {held_ids.numel():,}; model: {num_params:,} parameters")
    losses = train(model, train_ids, steps=args.steps, batch_size=args.batch_size, lr=args.lr)
    model = model.to(torch.bfloat16).to(torch.float32)  # perplexity of the weights as written
    held_ppl, train_ppl = perplexity(model, held_ids), perplexity(model, train_ids)
    print(f"perplexity: held-out {held_ppl:.2f}  train {train_ppl:.2f}  (vocab {VOCAB_SIZE})")

    save_file(checkpoint_tensors(model), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    generation = {"bos_token_id": 0, "eos_token_id": 0, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, out / name)
    copy_prompts(source / "prompts.jsonl", out / "prompts.jsonl", args.num_train_prompts)
    copy_prompts(source / "heldout_prompts.jsonl", out / "heldout_prompts.jsonl", args.num_heldout_prompts)
    build = {
        "tokenizer_from": str(source),
        "train_tokens": train_ids.numel(),
        "heldout_tokens": held_ids.numel(),
        "num_parameters": num_params,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": SEQ_LEN,
        "lr": args.lr,
        "final_train_loss": sum(losses[-20:]) / max(1, min(20, len(losses))),
        "heldout_perplexity": round(held_ppl, 3),
        "train_perplexity": round(train_ppl, 3),
        "vocab_size": VOCAB_SIZE,
        "build_seconds": round(time.time() - t0, 1),
        "torch": torch.__version__,
    }
    (out / "build.json").write_text(json.dumps(build, indent=2) + "\n")
    print(json.dumps(build))


if __name__ == "__main__":
    main()
