"""The committed tiny target: a real causal LM, loadable by transformers, rebuilt deterministically."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_tiny_target_loads_and_is_far_better_than_chance(tiny_target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    assert model.config.num_hidden_layers >= 8 and model.config.architectures == ["LlamaForCausalLM"]
    build = json.loads((tiny_target_dir / "build.json").read_text())
    assert build["heldout_perplexity"] < build["vocab_size"] / 20
    assert tokenizer.decode(tokenizer("def f(x):\n    return x")["input_ids"]) == "def f(x):\n    return x"


def test_heldout_prompts_do_not_overlap_training_prompts(tiny_target_dir):
    def contents(name):
        return {json.loads(line)["conversations"][0]["content"] for line in open(tiny_target_dir / name)}

    assert not contents("prompts.jsonl") & contents("heldout_prompts.jsonl")


def test_build_script_is_deterministic(tmp_path):
    digests = []
    for name in ("a", "b"):
        out = tmp_path / name
        subprocess.run(
            [
                sys.executable,
                str(REPO / "scripts" / "build_tiny_target.py"),
                "--out",
                str(out),
                "--steps",
                "2",
                "--num-train-prompts",
                "4",
                "--num-heldout-prompts",
                "2",
            ],
            check=True,
            capture_output=True,
        )
        digests.append(
            {
                f: hashlib.sha256((out / f).read_bytes()).hexdigest()
                for f in ("model.safetensors", "tokenizer.json", "prompts.jsonl", "heldout_prompts.jsonl")
            }
        )
    assert digests[0] == digests[1]
