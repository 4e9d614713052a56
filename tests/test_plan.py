"""`eyas plan CONFIG [--json]` (eyas_cli.plan): the memory plan per device of the Kimi-K2.5 preset on a stand-in
of its target (config.json and weight headers shaped like the checkpoint's, no weights: all the plan reads), and
of the tiny preset on the committed tiny target; the refusal with its fixes; a target that cannot be read."""

from __future__ import annotations

import json
from pathlib import Path

from target_fixtures import write_target

from eyas.config import load_run_config
from eyas.target import TargetFacts
from eyas.train.memory_plan import GIB, run_plan
from eyas_cli.main import main

REPO = Path(__file__).resolve().parents[1]


def kimi_preset(tmp_path: Path, **train) -> Path:
    """The Kimi-K2.5 preset on a header-only stand-in of its target (H 7168, vocab 163,840), written to a file."""
    config = load_run_config(REPO / "deployments" / "kimi-k25-8gpu.json")
    target = write_target(tmp_path / "kimi-k2.5", "kimi-k2.5")
    config = config.model_copy(
        update={
            "target": config.target.model_copy(update={"model_path": str(target)}),
            "train": config.train.model_copy(update=train),
        }
    )
    path = tmp_path / "kimi.json"
    path.write_text(config.model_dump_json())
    return path


def planned(path: Path):
    config = load_run_config(path)
    return run_plan(config, TargetFacts.read(config.target.model_path))


def test_the_kimi_preset_plans_each_h200_and_fits(tmp_path, capsys):
    path = kimi_preset(tmp_path)
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    plan = planned(path)
    assert plan.shape.arch.hidden_size == 7168 and plan.shape.arch.target_vocab_size == 163840
    assert out.startswith("memory plan of kimi-k25-8gpu: training on 8 processes (nccl, fsdp2, bf16, activation")
    for component, size, what in plan.rows:  # every component with its size and what it is
        assert f"  {component:32s} {size / GIB:9.2f} GiB  {what}\n" in out
    assert f"  {'peak':32s} {plan.peak_bytes / GIB:9.2f} GiB  of 139.8 GiB device\n" in out
    assert f"  {'usable':32s} {plan.usable_bytes / GIB:9.2f} GiB  of the device (10% kept for the allocator" in out
    assert "device budget: train.device_memory_gib=139.8\n" in out
    assert "micro-batches: 4,096 tokens (auto: chosen by the memory plan); at most 4 per rank per step" in out
    used = plan.peak_bytes / plan.usable_bytes
    assert out.endswith(
        f"fits: peak {plan.peak_bytes / GIB:.1f} GiB per device of 139.8 GiB, {used:.0%} of its 125.8 GiB usable\n"
    )
    assert plan.fits and plan.peak_bytes < plan.usable_bytes < plan.device_bytes  # room for the allocator


def test_json_prints_the_plans_dict(tmp_path, capsys):
    path = kimi_preset(tmp_path)
    assert main(["plan", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == planned(path).to_dict()


def test_a_plan_that_does_not_fit_is_refused_with_the_fixes(tmp_path, capsys):
    path = kimi_preset(tmp_path, parallelism="ddp", max_tokens_per_micro_batch=32768, device_memory_gib=80)
    assert main(["plan", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"eyas plan {path}: training needs ")
    assert "GiB per device at micro-batches of 32,768 tokens" in captured.err
    for fix in ("train.max_tokens_per_micro_batch", "train.activation_checkpointing=true", "train.parallelism='fsdp2'"):
        assert fix in captured.err
    assert main(["plan", str(path), "--json"]) == 2  # the plan still printed for a script, the refusal beside it
    captured = capsys.readouterr()
    assert json.loads(captured.out)["fits"] is False and "fixes: " in captured.err


def test_a_cuda_run_planned_away_from_its_gpus_says_the_device_is_not_known(tmp_path, capsys):
    path = kimi_preset(tmp_path, device_memory_gib=0)
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "device budget: not known here: train.device_memory_gib is 0, so the preflight plans against" in out
    assert "micro-batches: 4,096 tokens (auto: the most it may become; the preflight chooses it" in out
    assert "the device's memory is not known yet: the preflight checks the plan against the GPUs it finds\n" in out


def test_the_tiny_preset_plans_on_the_committed_tiny_target(monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the preset names its target relative to the checkout
    assert main(["plan", "deployments/tiny-cpu.json"]) == 0
    out = capsys.readouterr().out
    facts = TargetFacts.read("fixtures/tiny-target")
    assert f"  target fixtures/tiny-target: hidden {facts.hidden_size:,}, vocab {facts.vocab_size:,}; " in out
    assert "(gloo, ddp, fp32, activation checkpointing off)" in out
    assert "device budget: this host's available memory shared by train.num_processes=2" in out
    assert "(auto: chosen by the memory plan)" in out and "\nfits: peak " in out


def test_a_target_that_cannot_be_read_is_named_with_the_fix(tmp_path, capsys):
    path = kimi_preset(tmp_path)
    config = json.loads(path.read_text())
    config["target"]["model_path"] = str(tmp_path / "nowhere")
    path.write_text(json.dumps(config))
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"eyas plan {path}: cannot read the facts of target.model_path='{tmp_path / 'nowhere'}'")
    assert "no config.json" in err and "set target.model_path in the config" in err
