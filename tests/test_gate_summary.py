"""The gate summary's Memory section, its Risks, the smoke run's conditions and the Command block, on a Kimi-K2.5
run (H 7168, vocab 163,840, 8 ranks) laid out in all three layouts (terminal, Resume dialog, full artifact)."""

from __future__ import annotations

from pathlib import Path

from test_gate_terminal import shell_arguments, too_wide

from eyas.config import load_run_config
from eyas.facts import RunFacts, TargetFacts
from eyas.gate.summary import TERMINAL_WIDTH, gate_summary, review, terminal_text
from eyas.train.memory_plan import GIB, run_plan

REPO = Path(__file__).resolve().parents[1]
H, VOCAB, DRAFT_VOCAB = 7168, 163840, 32000
SMOKE = {"first_loss": 10.5, "last_loss": 3.25, "steps": 40, "samples": 8, "passed": True, "tokens_per_s": 20000.0,
         "device": "cpu", "modules": [{"module": "fc", "num_params": 3 * H * H, "shapes": {"weight": [H, 3 * H]},
                                       "trainable": True}]}  # fmt: skip
DEVICES = {"backend": "nccl", "num_processes": 8, "ok": True, "devices": []}


def kimi_config(workdir: Path, **train):
    config = load_run_config(REPO / "deployments" / "kimi-k25-8gpu.json")
    return config.model_copy(update={"workdir": str(workdir), "train": config.train.model_copy(update=train)})


def kimi_facts() -> RunFacts:
    facts = RunFacts.model_construct(
        target=TargetFacts.model_construct(hidden_size=H, vocab_size=VOCAB),
        aux_layer_ids=[2, 30, 58],
        num_samples=37000,
    )
    object.__setattr__(facts, "sample_lengths", lambda: [2373] * 37000)
    return facts


def summarize(config, *, smoke: dict | None = None, devices: dict | None = None):
    args = {"dataset": {}, "verified": {"mode": "cheap", "shards": 40, "ok": 40}}
    smoke, devices = smoke or SMOKE, devices or DEVICES
    return gate_summary(config, kimi_facts(), smoke=smoke, devices=devices, **args)


def flat(text: str) -> str:
    """The text with its line breaks and indentation gone (a wrapped sentence read whole)."""
    return " ".join(text.split())


def test_the_memory_section_shows_the_preflights_plan(tmp_path):
    config = kimi_config(tmp_path / "run")
    on_80 = run_plan(kimi_config(tmp_path / "run", device_memory_gib=80), kimi_facts().target).to_dict()
    summary = summarize(config, devices={**DEVICES, "plan": on_80})
    used = on_80["peak_bytes"] / on_80["usable_bytes"]
    peak = (
        f"fits: peak {on_80['peak_bytes'] / GIB:.1f} GiB per device of 80.0 GiB, {used:.0%} of its "
        f"{on_80['usable_bytes'] / GIB:.1f} GiB usable"
    )
    largest = sorted(on_80["rows"], key=lambda r: -r["bytes"])[:3]
    assert largest[0]["component"] == "activations"
    terminal = flat(summary.terminal)
    assert f"Memory {peak} micro-batches of 4,096 tokens (auto: chosen by the memory plan) largest: " in terminal
    assert ", ".join(f"{r['component']} {r['bytes'] / GIB:.1f} GiB" for r in largest) in terminal
    assert f"- **memory** {peak}; micro-batches of 4,096 tokens" in summary.dialog
    assert "## Memory plan" in summary.full
    for row in on_80["rows"]:  # the full artifact lists every component
        assert f"| {row['component']} | {row['bytes'] / GIB:.2f} | {row['what']} |" in summary.full
    assert not too_wide(summary.terminal), too_wide(summary.terminal)


def test_without_the_preflights_plan_the_gate_plans_from_the_config(tmp_path):
    config = kimi_config(tmp_path / "run")
    plan = run_plan(config, kimi_facts().target)
    summary = summarize(config, devices={**DEVICES, "plan": None})  # a preflight that had no facts
    assert f"fits: peak {plan.peak_bytes / GIB:.1f} GiB per device of 139.8 GiB" in flat(summary.terminal)
    unknown = summarize(kimi_config(tmp_path / "run", device_memory_gib=0))  # no device known: no verdict
    assert "the device's memory is not known yet" in flat(unknown.terminal)
    assert "auto: the most it may become" in flat(unknown.terminal) and "Risks" not in unknown.terminal


def test_a_checkpoint_save_longer_than_half_the_collective_timeout_is_a_risk(tmp_path):
    config = kimi_config(tmp_path / "run", collective_timeout_s=3600)
    risk = (
        "a checkpoint save took 1,900.5 s in the smoke run, more than half of train.collective_timeout_s=3600: "
        "raise it, or write checkpoints to faster storage"
    )
    slow = summarize(config, smoke={**SMOKE, "save_s": 1900.5})
    assert f"Risks {risk}" in flat(slow.terminal)
    assert f"- **risk** {risk}" in slow.dialog and f"## Risks\n\n- {risk}" in slow.full
    assert not too_wide(slow.terminal)
    for smoke in ({**SMOKE, "save_s": 1800.0}, SMOKE):  # half the timeout, or an older smoke result without it
        summary = summarize(config, smoke=smoke)
        assert "Risks" not in summary.terminal and "**risk**" not in summary.dialog and "## Risks" not in summary.full


def test_a_plan_that_does_not_fit_the_device_is_a_risk(tmp_path):
    config = kimi_config(tmp_path / "run", parallelism="ddp", max_tokens_per_micro_batch=32768, device_memory_gib=80)
    summary = summarize(config)
    assert "Memory DOES NOT FIT: peak" in flat(summary.terminal)
    assert "Risks the memory plan does not fit the device: peak" in flat(summary.terminal)
    assert "`eyas plan CONFIG` names the fixes" in flat(summary.terminal)


def test_the_smoke_runs_device_and_precision_stand_beside_its_speed(tmp_path):
    config = kimi_config(tmp_path / "run")
    smoke = {**SMOKE, "device": "cuda:0", "precision": "bf16", "save_s": 12.04, "peak_bytes": 41 * GIB}
    summary = summarize(config, smoke=smoke)
    conditions = "on cuda:0 in bf16 at 20,000 tokens/s; checkpoint save 12.0 s; measured peak 41.0 GiB"
    lines = summary.terminal.splitlines()
    smoke_line = next(i for i, line in enumerate(lines) if line.startswith("Smoke "))
    assert lines[smoke_line].endswith("samples: passed")  # the line the demo's terminal test reads
    assert lines[smoke_line + 1].startswith(" " * 10 + "on cuda:0 in bf16 at 20,000 tokens/s;")
    assert f"samples: passed {conditions} Devices" in flat(summary.terminal)
    assert f"- **smoke run** loss 10.500 -> 3.250 in 40 steps on 8 samples: passed; {conditions}" in summary.dialog
    assert "on cpu at 20,000 tokens/s" in summarize(config).terminal  # an older smoke result: no precision


def test_a_command_argument_longer_than_the_terminal_is_split_and_pasted_runs_it(tmp_path):
    """A workdir path longer than 80 columns, with a space: the Command block is flush left, every line fits,
    and bash reads the block back as the very command."""
    workdir = tmp_path / ("a run directory " + "x" * 90) / "run"
    config = kimi_config(workdir)
    r = review(config, kimi_facts(), dataset={}, verified={"mode": "cheap"}, smoke=SMOKE, devices=DEVICES)
    text = terminal_text(r)
    block = text.split("\nCommand\n", 1)[1].splitlines()
    assert len(str(workdir / "train" / "job.json")) > TERMINAL_WIDTH
    assert max(map(len, block)) <= TERMINAL_WIDTH, block
    assert shell_arguments(block) == r["command"], block
    assert not too_wide(text)


def on_nodes(workdir: Path, **train):
    """The Kimi run with its train section validated (the endpoint given its port) after `train`'s changes."""
    config = kimi_config(workdir)
    data = {**config.train.model_dump(mode="json"), **train}
    return config.model_copy(update={"train": type(config.train).model_validate(data)})


def test_a_run_on_several_nodes_shows_its_nodes_world_and_each_nodes_command(tmp_path):
    config = on_nodes(tmp_path / "run", num_nodes="2:4", num_processes=8, rdzv_endpoint="node-0",
                      node_deployment="train-node/kimi-k25-8gpu", rdzv_last_call_timeout_s=60)  # fmt: skip
    summary = summarize(config, smoke={**SMOKE, "device": "cuda:0"})
    nodes = (
        "2 to 4 nodes x 8 processes (world size 16 to 32); the command below on every node: the training flow "
        "starts nodes 2-4 as flow runs of train-node/kimi-k25-8gpu; c10d rendezvous at node-0:29400, join timeout "
        "600 s"
    )
    assert f"Nodes {nodes}" in flat(summary.terminal)
    assert f"- **nodes** {nodes}" in summary.dialog and f"## Nodes\n\n{nodes}" in summary.full
    command = shell_arguments(summary.terminal.split("\nCommand\n", 1)[1].splitlines())
    assert "--nnodes=2:4" in command and "--rdzv-endpoint=node-0:29400" in command
    assert "on 16 processes at the smoke run's" in flat(summary.terminal)  # the estimate at the fewest nodes
    by_hand = summarize(on_nodes(tmp_path / "run", num_nodes=2, rdzv_endpoint="10.0.0.5"))
    assert "start it on every further node by hand, on machines sharing the run's directory" in flat(by_hand.terminal)
    assert "Nodes" not in summarize(config.model_copy(update={"train": kimi_config(tmp_path).train})).terminal
