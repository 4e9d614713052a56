"""Training on several nodes under torch's elastic launcher (train.num_nodes): eyas's torchrun command for a node,
and two real torchrun agents on loopback (c10d rendezvous, 2 gloo processes each) training the tiny run to the
same weights, bit for bit, as one agent of 4 processes.

Bit for bit, because nothing a rank computes depends on how its 4 processes are spread over agents: the global
rank fixes a rank's share of each batch, gloo picks its allreduce algorithm from the world size and the tensor
(both the same), and DDP's buckets from the model. What differs is only how the processes met."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from run_fixtures import tiny_job, write_tiny_run
from safetensors.torch import load_file
from torchrun_agents import REPO, free_port, run_agents

from eyas.config import RunConfig, load_run_config
from eyas.train.checkpoint import latest_complete, read_trainer_state
from eyas.train.launch import rendezvous_id, torchrun_command, torchrun_launcher
from eyas.train.metrics import parse_metric_line

NUM_SAMPLES, BATCH, STEPS = 32, 8, 4


def train_on(tiny_run: dict, root: Path, *, agents: int, **train) -> dict:
    """The tiny job on `agents` torchrun agents started with eyas's own launcher command; its output dir, the
    metric records every agent printed, and the final weights."""
    out = root / "out"
    job = tiny_job(tiny_run, out, num_epochs=1, max_steps=STEPS, global_batch_size=BATCH, save_every_steps=2, **train)
    job_path = root / "job.json"
    job_path.write_text(job.model_dump_json())
    cmd = [*torchrun_launcher(job.train, rdzv_id=f"eyas-test-{root.name}"), "-m", "eyas.train", "--config",
           str(job_path)]  # fmt: skip
    outputs = run_agents([cmd] * agents, [root / f"agent-{i}.log" for i in range(agents)])
    metrics = [m for text in outputs for m in map(parse_metric_line, text.splitlines()) if m is not None]
    checkpoint = latest_complete(out)
    return {"out": out, "cmd": cmd, "metrics": metrics, "checkpoint": checkpoint,
            "weights": load_file(checkpoint / "model.safetensors")}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    return write_tiny_run(tmp_path_factory.mktemp("multinode-run"), num_samples=NUM_SAMPLES)


@pytest.fixture(scope="module")
def two_nodes(tiny_run, tmp_path_factory) -> dict:
    """2 "nodes" x 2 processes: two agents meeting at a c10d rendezvous on loopback."""
    endpoint = f"127.0.0.1:{free_port()}"
    return train_on(tiny_run, tmp_path_factory.mktemp("two-nodes"), agents=2, num_processes=2, num_nodes=2,
                    rdzv_endpoint=endpoint, rdzv_join_timeout_s=120)  # fmt: skip


@pytest.fixture(scope="module")
def one_node(tiny_run, tmp_path_factory) -> dict:
    """1 node x 4 processes: one agent, `--standalone`."""
    return train_on(tiny_run, tmp_path_factory.mktemp("one-node"), agents=1, num_processes=4)


def test_two_agents_train_to_the_weights_of_one_agent_bit_for_bit(two_nodes, one_node):
    assert "--rdzv-backend=c10d" in two_nodes["cmd"] and "--standalone" in one_node["cmd"]
    assert two_nodes["checkpoint"].name == one_node["checkpoint"].name == f"step-{STEPS:08d}"
    for run in (two_nodes, one_node):
        state = read_trainer_state(run["checkpoint"])
        assert (state["world_size"], state["samples_consumed"]) == (4, STEPS * BATCH)
    a, b = two_nodes["weights"], one_node["weights"]
    assert sorted(a) == sorted(b)
    differing = sorted(k for k in a if not torch.equal(a[k], b[k]))
    assert differing == [], differing
    earlier = load_file(two_nodes["out"] / "checkpoints" / "step-00000002" / "model.safetensors")
    assert not torch.equal(earlier["fc.weight"], a["fc.weight"])  # the steps compared moved the weights


def test_the_two_agents_print_one_metric_record_per_step(two_nodes, one_node):
    """Only global rank 0 prints the metric line, whichever agent started it: one record a step between them,
    with the losses of the one-agent run."""
    assert [m["step"] for m in two_nodes["metrics"]] == list(range(1, STEPS + 1))
    lines = (two_nodes["out"] / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == two_nodes["metrics"]
    assert [m["loss"] for m in two_nodes["metrics"]] == [m["loss"] for m in one_node["metrics"]]
    assert [m["sample_ids"] for m in two_nodes["metrics"]] == [m["sample_ids"] for m in one_node["metrics"]]


def run_config(**train) -> RunConfig:
    data = load_run_config(REPO / "deployments" / "tiny-cpu.json").model_dump(mode="json")
    data["train"].update(train)
    return RunConfig.model_validate(data)


def test_one_node_keeps_the_standalone_command():
    config = run_config()
    assert torchrun_command(config, Path("/r/train/job.json")) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={config.train.num_processes}", "-m", "eyas.train", "--config", "/r/train/job.json",
    ]  # fmt: skip


def test_several_nodes_launch_under_the_c10d_rendezvous():
    config = run_config(num_nodes="2:4", num_processes=8, rdzv_endpoint="node-0", rdzv_join_timeout_s=900,
                        rdzv_last_call_timeout_s=60, max_restarts=5)  # fmt: skip
    assert torchrun_command(config, Path("job.json")) == [
        "env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", sys.executable, "-m", "torch.distributed.run",
        "--nnodes=2:4", "--nproc_per_node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=node-0:29400",
        f"--rdzv-id={rendezvous_id(config)}", "--rdzv-conf=join_timeout=900,last_call_timeout=60",
        "--max-restarts=5", "-m", "eyas.train", "--config", "job.json",
    ]  # fmt: skip
    assert "--max-restarts=3" in torchrun_command(run_config(num_nodes=2, rdzv_endpoint="h"), Path("job.json"))


def test_max_restarts_with_one_node_is_refused():
    """torchrun --standalone is given no --max-restarts: on one node the train task relaunches instead."""
    with pytest.raises(ValueError) as err:
        run_config(max_restarts=5)
    assert (
        "train.max_restarts=5 would do nothing: train.num_nodes=1 trains on this node alone (torchrun --standalone, "
        "whose workers torch does not restart); there the train task relaunches a failed launch that made progress, "
        "from the newest complete checkpoint; remove it, or set train.num_nodes"
    ) in str(err.value)
    assert run_config(num_nodes="1:2", rdzv_endpoint="h", max_restarts=0).train.max_restarts == 0


def test_the_rendezvous_id_is_the_runs_own_unless_given():
    config = run_config(num_nodes=2, rdzv_endpoint="10.0.0.5:29500")
    assert rendezvous_id(config) == rendezvous_id(run_config(num_nodes=2, rdzv_endpoint="10.0.0.5:29500"))
    assert rendezvous_id(config).startswith(f"{config.name}-")
    moved = RunConfig.model_validate({**config.model_dump(mode="json"), "workdir": "/elsewhere"})
    assert rendezvous_id(moved) != rendezvous_id(config)
    assert rendezvous_id(run_config(num_nodes=2, rdzv_endpoint="h", rdzv_id="job-7")) == "job-7"
