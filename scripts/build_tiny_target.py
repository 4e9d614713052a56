"""Build the tiny target: a Llama-architecture causal LM trained on Python's own stdlib source.

Usage: python scripts/build_tiny_target.py [--out fixtures/tiny-target] [--steps 1200]

Everything comes from what is on the machine (the running interpreter's standard library),
so the build needs no network. With the same Python and torch it is deterministic: files are
read in sorted order, the tokenizer trains single-threaded, torch runs with a fixed seed and
deterministic algorithms. Every tenth source file is held out: the held-out perplexity and
the held-out prompt set come from those files only.

Writes, in Hugging Face format: config.json, generation_config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, special_tokens_map.json; and beside them
prompts.jsonl (draft-training prompts, from training files), heldout_prompts.jsonl (from
held-out files) and build.json (hyperparameters, losses, held-out perplexity).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

EOS = "<|endoftext|>"
VOCAB_SIZE = 2048
SEQ_LEN = 128
HOLDOUT_EVERY = 10
PROMPT_CHARS = (120, 240)


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """The stdlib's top-level modules, sorted; every HOLDOUT_EVERY-th is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(Path(p) for p in glob.glob(str(root / "*.py")))
    if len(files) < 50:
        raise SystemExit(f"stdlib at {root}: found {len(files)} *.py files, expected >= 50")
    train = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    held = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    return train, held


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_corpus(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    eos_id = tok.token_to_id(EOS)
    ids: list[int] = []
    for text in texts:
        ids.extend(tok.encode(text).ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def make_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config)


def batches(ids: torch.Tensor, batch_size: int, gen: torch.Generator):
    limit = ids.numel() - SEQ_LEN - 1
    while True:
        starts = torch.randint(0, limit, (batch_size,), generator=gen)
        yield torch.stack([ids[s : s + SEQ_LEN + 1] for s in starts.tolist()])


def train(model, train_ids: torch.Tensor, *, steps: int, batch_size: int, lr: float) -> list[float]:
    """Next-token training with AdamW, a linear warm-up and a cosine decay; the loss of every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)),
    )
    stream = batches(train_ids, batch_size, torch.Generator().manual_seed(0))
    losses, t0 = [], time.time()
    model.train()
    for step in range(steps):
        batch = next(stream)
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - t0:6.0f}s", flush=True)
    return losses


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, ids: torch.Tensor, num_windows: int = 64) -> float:
    model.eval()
    stride = max(1, (ids.numel() - SEQ_LEN - 1) // num_windows)
    windows = torch.stack([ids[i * stride : i * stride + SEQ_LEN + 1] for i in range(num_windows)])
    out = model(input_ids=windows[:, :-1], labels=windows[:, :-1].clone())
    # labels are shifted inside the model: this is mean next-token NLL over the windows
    model.train()
    return math.exp(out.loss.item())


def make_prompts(texts: list[str], count: int, seed: int, prefix: str) -> list[dict]:
    """Prompts are code prefixes starting at a `def ` or `class ` line, cut at a line end."""
    rng = random.Random(seed)
    candidates = []
    for ti, text in enumerate(texts):
        pos = 0
        while True:
            pos = text.find("\ndef ", pos) if rng.random() < 0.5 else text.find("\n    def ", pos)
            if pos < 0:
                break
            candidates.append((ti, pos + 1))
            pos += 1
    rng.shuffle(candidates)
    prompts, seen = [], set()
    for ti, start in candidates:
        text = texts[ti]
        want = rng.randint(*PROMPT_CHARS)
        end = text.rfind("\n", start, start + want)
        if end <= start + 40:
            continue
        content = text[start : end + 1]
        if content in seen:
            continue
        seen.add(content)
        prompts.append({"id": f"{prefix}-{len(prompts):05d}", "conversations": [{"role": "user", "content": content}]})
        if len(prompts) == count:
            break
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fixtures/tiny-target")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--num-train-prompts", type=int, default=768)
    parser.add_argument("--num-heldout-prompts", type=int, default=48)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    train_files, held_files = stdlib_files()
    train_texts = [read_text(f) for f in train_files]
    held_texts = [read_text(f) for f in held_files]
    tok = train_tokenizer(train_texts)
    train_ids = encode_corpus(tok, train_texts)
    held_ids = encode_corpus(tok, held_texts)
    print(f"tokens: train {train_ids.numel():,}  held-out {held_ids.numel():,}")

    model = make_model()
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params:,} parameters")
    t0 = time.time()
    losses = train(model, train_ids, steps=args.steps, batch_size=args.batch_size, lr=args.lr)

    held_ppl = perplexity(model, held_ids)
    train_ppl = perplexity(model, train_ids)
    print(f"perplexity: held-out {held_ppl:.2f}  train {train_ppl:.2f}  (vocab {VOCAB_SIZE})")

    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)
    hf_tok.save_pretrained(out)

    write_jsonl(out / "prompts.jsonl", make_prompts(train_texts, args.num_train_prompts, 1, "train"))
    write_jsonl(out / "heldout_prompts.jsonl", make_prompts(held_texts, args.num_heldout_prompts, 2, "heldout"))
    build = {
        "python_stdlib": sysconfig.get_paths()["stdlib"],
        "train_files": len(train_files),
        "heldout_files": len(held_files),
        "train_tokens": train_ids.numel(),
        "heldout_tokens": held_ids.numel(),
        "num_parameters": num_params,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": SEQ_LEN,
        "lr": args.lr,
        "final_train_loss": sum(losses[-20:]) / min(20, len(losses)),
        "heldout_perplexity": round(held_ppl, 3),
        "train_perplexity": round(train_ppl, 3),
        "vocab_size": VOCAB_SIZE,
        "build_seconds": round(time.time() - t0, 1),
        "torch": torch.__version__,
    }
    (out / "build.json").write_text(json.dumps(build, indent=2) + "\n")
    print(json.dumps(build))


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
