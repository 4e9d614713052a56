"""Drafter checkpoints written by the real speculators package, and speculators' own forward on a checkpoint.

    python scripts/kits.py run speculators-0.9.0 -- python scripts/build_speculators_fixtures.py build \\
        --out DIR --version 0.9.0
    python scripts/kits.py run speculators-0.9.0 -- python scripts/build_speculators_fixtures.py forward \\
        --checkpoint DRAFT --inputs IN.safetensors --out OUT.safetensors

Run it under a kit (kits/speculators-*.txt): the package and the transformers release it pins come from
the kit, torch from the environment. `build` checks the installed speculators release, writes a tiny random
verifier (LlamaForCausalLM, 8 layers, hidden 64, vocab 512) to DIR/verifier and, for each entry of
FIXTURES, goes through the package's own training path, as `speculators train` does:
  speculators.train.cli.create_transformer_layer_config(...)                 the draft decoder's config
  speculators.train.vocab_mapping.build_vocab_mappings_from_distribution(...)  d2t offsets, bool t2d
  Eagle3DraftModel.from_training_args(verifier_config=..., t2d=, d2t=, **options)
  model.to(bfloat16); model.save_pretrained(DIR/NAME)                      what training checkpoints are
Every norm weight is set to 1 + 0.1 N(0, 1) first (seeded): a fresh draft has all norms at 1, which would
hide a skipped or swapped norm. DIR/NAME/reference.safetensors then holds inputs and speculators' own
forward on the checkpoint as saved (from_pretrained, float32, sdpa attention, 3 TTT steps): hidden_states
[1, T, n_aux*H], input_ids, document_ids, position_ids, logits_step{k} [1, T, draft vocab] (from a hook on
lm_head) and draft_tokens_step{k}. DIR/manifest.json records the releases, options, keys and sha256s.
`forward` runs the same forward on any speculators-format checkpoint (an eyas export included) for the
inputs in IN.safetensors and writes the logits to OUT.safetensors.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import warnings
from importlib.metadata import version as dist_version
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

OPTIONS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")  # eyas.draft_keys order


def option_fixtures() -> dict[str, dict]:
    """{name: from_training_args options} for every valid combination of the norm options (speculators refuses
    norm_before_fc with fc_norm); the name is the options joined by "+", "plain" for none."""
    out = {}
    for before_fc in ("norm_before_fc", "fc_norm", None):
        for residual in (False, True):
            for output in (False, True):
                on = [before_fc] if before_fc else []
                on += ["norm_before_residual"] if residual else []
                on += ["norm_output"] if output else []
                out["+".join(on) or "plain"] = dict.fromkeys(on, True)
    return out


# name -> (from_training_args options, build options). "cli_defaults" is what `speculators train
# --speculator-type eagle3` builds when no flag is given (train/config/schema.py: norm_before_residual true,
# norm_before_fc and norm_output true for eagle3, sliding_window 2048 without --full-attention-indices).
FIXTURES: dict[str, tuple[dict, dict]] = {
    **{name: (options, {}) for name, options in option_fixtures().items()},
    "cli_defaults": ({"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}, {"sliding": True}),
    "layer_ids_1_4_8": ({}, {"target_layer_ids": [1, 4, 8]}),
    "full_vocab": ({}, {"full_vocab": True}),
}
VERIFIER = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
DRAFT_VOCAB = 128
SEQ_LEN = 12
TTT_STEPS = 3
REFERENCE_ATTN = "sdpa"  # boolean masks; "simple_flex_attention" (the default) needs T % 128 == 0 on CPU


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_verifier(path: Path, seed: int) -> None:
    seed_all(seed)
    model = LlamaForCausalLM(LlamaConfig(**VERIFIER))
    with torch.no_grad():  # a final norm other than ones, so that a draft copying it is visible
        model.model.norm.weight.copy_(1 + 0.1 * torch.randn_like(model.model.norm.weight))
    model.to(torch.bfloat16).save_pretrained(path)


def token_counts(vocab: int, seed: int) -> dict[int, int]:
    counts = torch.randint(0, 1000, (vocab,), generator=torch.Generator().manual_seed(seed))
    return {i: int(c) for i, c in enumerate(counts) if c > 0}


def perturb_norms(model: torch.nn.Module, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    touched = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1 and not name.startswith("verifier_"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
                touched.append(name)
    return touched


def speculators_forward(checkpoint: Path, inputs: dict[str, torch.Tensor], ttt_steps: int) -> dict[str, torch.Tensor]:
    """speculators' own forward on a checkpoint as saved: logits of each TTT step (hooked from lm_head) and
    the tokens it returns."""
    from speculators.models.eagle3 import Eagle3DraftModel

    config = Eagle3DraftModel.config_class.from_pretrained(checkpoint)
    config.transformer_layer_config._attn_implementation = REFERENCE_ATTN
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Eagle3DraftModel.from_pretrained(checkpoint, config=config).float().eval()
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out.detach().float().clone()))
    with torch.no_grad():
        tokens = model(**{k: v.clone() for k, v in inputs.items()}, ttt_steps=ttt_steps)
    hook.remove()
    out = {f"logits_step{k}": v.contiguous() for k, v in enumerate(logits)}
    out.update({f"draft_tokens_step{k}": v.contiguous() for k, v in enumerate(tokens)})
    return out


def build_one(name: str, options: dict, build: dict, verifier: str, seed: int) -> dict:
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    seed_all(seed)
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=verifier,
        num_layers=1,
        draft_arch="llama",
        hidden_act="silu",  # --draft-hidden-act default
        sliding_window=2048,  # --sliding-window default
        full_attention_indices=[] if build.get("sliding") else [0],
        mrope_full_head_hack=True,
    )
    vocab = layer_config.vocab_size
    if build.get("full_vocab"):
        d2t = t2d = None
        draft_vocab = vocab
    else:
        d2t, t2d = build_vocab_mappings_from_distribution(token_counts(vocab, seed), DRAFT_VOCAB, vocab)
        draft_vocab = DRAFT_VOCAB
    args = {
        "draft_vocab_size": draft_vocab,
        **dict.fromkeys(OPTIONS, False),
        "embed_requires_grad": False,
        "ttt_steps": TTT_STEPS,
        "verifier_name_or_path": verifier,
        "target_layer_ids": build.get("target_layer_ids"),
        "draft_attn_impl": "simple_flex_attention",
        **options,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Eagle3DraftModel.from_training_args(verifier_config=layer_config, t2d=t2d, d2t=d2t, **args)
    perturbed = perturb_norms(model, seed + 1)
    model.to(torch.bfloat16)
    ckpt = Path(name)
    model.save_pretrained(ckpt)

    n_aux = len(model.config.eagle_aux_hidden_state_layer_ids)
    g = torch.Generator().manual_seed(seed + 2)
    inputs = {
        "hidden_states": torch.randn(1, SEQ_LEN, n_aux * model.hidden_size, generator=g),
        "input_ids": torch.randint(0, vocab, (1, SEQ_LEN), generator=g),
        "document_ids": torch.zeros(1, SEQ_LEN, dtype=torch.long),
        "position_ids": 1 + torch.arange(SEQ_LEN).unsqueeze(0),
    }
    reference = {**inputs, **speculators_forward(ckpt, inputs, TTT_STEPS)}
    save_file(reference, str(ckpt / "reference.safetensors"), metadata={"ttt_steps": str(TTT_STEPS)})
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        keys = {k: {"shape": list(f.get_slice(k).get_shape()), "dtype": f.get_slice(k).get_dtype()} for k in f.keys()}
    return {
        "options": {k: args[k] for k in OPTIONS},
        "build": build,
        "perturbed_norms": perturbed,
        "keys": dict(sorted(keys.items())),
        "files": {p.name: sha256(p) for p in sorted(ckpt.iterdir()) if p.is_file()},
    }


def build(out: Path, expected: str, seed: int) -> None:
    found = dist_version("speculators")
    if found != expected:
        raise SystemExit(f"speculators {found} is installed on this path, expected {expected}: run it under its kit")
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(out)  # the verifier path written into each config.json is relative: "verifier"
    write_verifier(Path("verifier"), seed)
    manifest = {
        "speculators": found,
        "transformers": dist_version("transformers"),
        "torch": torch.__version__,
        "seed": seed,
        "seq_len": SEQ_LEN,
        "ttt_steps": TTT_STEPS,
        "reference_attn_implementation": REFERENCE_ATTN,
        "fixtures": {},
    }
    for name, (options, build_options) in FIXTURES.items():
        manifest["fixtures"][name] = build_one(name, options, build_options, "verifier", seed)
        print(f"built {out / name}", flush=True)
    Path("manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="build every fixture into --out")
    b.add_argument("--out", required=True, type=Path)
    b.add_argument("--version", required=True, help="the speculators release expected on the path")
    b.add_argument("--seed", type=int, default=0)
    f = sub.add_parser("forward", help="speculators' forward on a checkpoint")
    f.add_argument("--checkpoint", required=True, type=Path)
    f.add_argument("--inputs", required=True, type=Path, help="safetensors with hidden_states, input_ids, ...")
    f.add_argument("--out", required=True, type=Path)
    f.add_argument("--ttt-steps", type=int, default=TTT_STEPS)
    args = ap.parse_args()
    if args.verb == "build":
        build(args.out.resolve(), args.version, args.seed)
    else:
        torch.set_num_threads(1)
        inputs = load_file(args.inputs)
        save_file(speculators_forward(args.checkpoint, inputs, args.ttt_steps), str(args.out))


if __name__ == "__main__":
    main()
