"""A node lost while training (train.num_nodes, train.max_restarts): two real torchrun agents on loopback (c10d
rendezvous, 2 gloo processes each) train the tiny job, and one agent is SIGKILLed with its workers once the
first checkpoint is complete.

- num_nodes "1:2": the survivor's workers fail in their next collective with the dead ones (gloo: the
  connection closed by the peer), its agent stops them and, having --max-restarts left, re-runs the rendezvous:
  once the dead node's keep-alive expired (torch's 3 x 5 s) the one node left forms the next round, and its new
  workers resume from the newest complete checkpoint at world size 2 and finish the run.
- num_nodes 2 (MIN 2): that round cannot form; the survivor exits non-zero once train.rdzv_join_timeout_s passed,
  eyas's launch failure says why, and both agents started again resume from the newest complete checkpoint.

The agent killed is never the one on the rendezvous endpoint: torch's c10d backend serves the rendezvous store
from the agent on the endpoint's host (on loopback both match: the first to bind the port serves it, the other
connects), so that agent IS the rendezvous. Losing it ends every agent's next rendezvous, and the job with it; a
retry (the train task's relaunch) starts the job anew from the newest checkpoint. The tests start the store's
agent first and wait until its port answers.

The kill lands mid-training through real knobs only: a checkpoint every step (rank 0 writes and fsyncs each)
and enough steps that the run is far from its end when the first one completes."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest
import torch
from run_fixtures import tiny_job, write_tiny_run
from safetensors.torch import load_file
from torchrun_agents import AGENT_TIMEOUT_S, agents_killed_at_exit, free_port, kill_agent, start_agent

from eyas.train.checkpoint import latest_complete, read_trainer_state
from eyas.train.launch import JOB_FILE, LOG_FILE, launch_failed, torchrun_launcher
from eyas.train.metrics import METRICS_FILE, read_metrics

NUM_SAMPLES, BATCH, STEPS = 64, 8, 16
JOIN_TIMEOUT_S = 10  # how long a survivor below MIN waits for the lost node (train.rdzv_join_timeout_s)
# A resumed run's weights equal the uninterrupted run's up to float rounding, not bit for bit, whatever the world
# size: at world size 2 each rank sums a larger share of a batch's gradient before the allreduce sums the shares,
# so the steps after the resume add the same terms in another order; at 4 a resume on ONE node differs from its
# uninterrupted run just as much (1.2e-7), the nodes play no part: DDP reduces the first step of a launch in its
# initial gradient buckets and rebuilds them after it, and gloo adds an element's 4 terms in an order set by its
# place in a bucket (2 terms add exactly in either order: tests/test_train_crash.py's 2-process resume is bit for
# bit). Measured here: 1.2e-7 at most, either way.
WEIGHT_TOLERANCE = 1e-5
# With MIN 1 the first agent would train alone until the second joins within this; it does, well before, so both
# runs compared start at world size 4.
LAST_CALL_S = 10
RESUMED = re.compile(r"resumed from \S+ at step (\d+) .*saved with world size (\d+), now (\d+)")


def wait_for(condition, what: str, guard_s: float = AGENT_TIMEOUT_S) -> None:
    """Poll until `condition()` holds; the guard only keeps a broken run from hanging the suite."""
    deadline = time.monotonic() + guard_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what} after {guard_s} s"
        time.sleep(0.05)


def answers(endpoint: str) -> bool:
    host, port = endpoint.rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


def job_for(tiny_run: dict, out: Path, **train):
    """The tiny job, a checkpoint every step, written where the train stage writes it (OUTPUT/job.json)."""
    job = tiny_job(tiny_run, out, num_epochs=2, max_steps=STEPS, global_batch_size=BATCH, save_every_steps=1,
                   num_processes=2, **train)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / JOB_FILE).write_text(job.model_dump_json(indent=2))
    return job


def start_nodes(job, out: Path, logs: list[Path]) -> list:
    """Both agents, the store's first (it is the one that binds the endpoint's port); each logs to its own file."""
    cmd = [*torchrun_launcher(job.train, rdzv_id=f"eyas-death-{out.parent.name}"), "-m", "eyas.train", "--config",
           str(out / JOB_FILE)]  # fmt: skip
    host = start_agent(cmd, logs[0])
    wait_for(lambda: answers(job.train.rdzv_endpoint) or host.poll() is not None, "the rendezvous store")
    return [host, start_agent(cmd, logs[1])]


def kill_after_first_checkpoint(procs: list, out: Path) -> str:
    """SIGKILL the agent that does not serve the store, with its workers, once a checkpoint is complete; the
    newest complete checkpoint at the kill."""
    wait_for(lambda: latest_complete(out) is not None or any(p.poll() is not None for p in procs), "a checkpoint")
    kill_agent(procs[1])
    newest = latest_complete(out)
    return newest.name if newest else "none"


def resumed_from(log: str) -> list[tuple[int, int, int]]:
    """(step, saved world size, world size) of each resume rank 0 logged."""
    return [tuple(map(int, m.groups())) for m in RESUMED.finditer(log)]


def max_difference(a: dict, b: dict) -> tuple[float, str]:
    """The largest absolute difference between two checkpoints' floating tensors, and the tensor's name; their
    other tensors (d2t, t2d) must be equal."""
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a if not a[k].is_floating_point())
    differences = {k: (a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point()}
    worst = max(differences, key=differences.get)
    return differences[worst], worst


def finished(out: Path) -> dict:
    checkpoint = latest_complete(out)
    return {"state": read_trainer_state(checkpoint), "weights": load_file(checkpoint / "model.safetensors"),
            "metrics": read_metrics(out / METRICS_FILE)}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    return write_tiny_run(tmp_path_factory.mktemp("death-run"), num_samples=NUM_SAMPLES)


@pytest.fixture(scope="module")
def uninterrupted(tiny_run, tmp_path_factory) -> dict:
    """2 nodes x 2 processes, nobody killed: the run the survivors must reproduce."""
    root = tmp_path_factory.mktemp("uninterrupted")
    job = job_for(tiny_run, root / "out", num_nodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}")
    with agents_killed_at_exit(start_nodes(job, root / "out", [root / "a.log", root / "b.log"])) as procs:
        codes = [p.wait(timeout=AGENT_TIMEOUT_S) for p in procs]
    assert codes == [0, 0], (root / "a.log").read_text()[-4000:]
    return finished(root / "out")


@pytest.fixture(scope="module")
def survivor_goes_on(tiny_run, tmp_path_factory) -> dict:
    """num_nodes 1:2: the second agent killed after the first checkpoint; the first trains on alone."""
    root = tmp_path_factory.mktemp("elastic")
    out, logs = root / "out", [root / "host.log", root / "lost.log"]
    job = job_for(tiny_run, out, num_nodes="1:2", rdzv_endpoint=f"127.0.0.1:{free_port()}",
                  rdzv_last_call_timeout_s=LAST_CALL_S)  # fmt: skip
    with agents_killed_at_exit(start_nodes(job, out, logs)) as procs:
        killed_at = kill_after_first_checkpoint(procs, out)
        code = procs[0].wait(timeout=AGENT_TIMEOUT_S)
    log = logs[0].read_text()
    assert code == 0, log[-4000:]
    return {**finished(out), "killed_at": killed_at, "resumes": resumed_from(log), "log": log}


def test_the_survivor_resumes_at_its_world_size_and_finishes(survivor_goes_on):
    run = survivor_goes_on
    assert len(run["resumes"]) == 1, run["resumes"]
    step, saved_world, world = run["resumes"][0]
    assert (saved_world, world) == (4, 2) and step >= int(run["killed_at"].removeprefix("step-")), run["resumes"]
    assert step < STEPS, f"the kill landed after the run's end (resumed at step {step})"
    state = run["state"]
    assert (state["step"], state["samples_consumed"], state["world_size"]) == (STEPS, STEPS * BATCH, 2)


def test_the_survivor_leaves_one_metric_record_per_step(survivor_goes_on, uninterrupted):
    metrics = survivor_goes_on["metrics"]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # the sample order is a function of the seed and the global batch, not of the world size
    assert [m["sample_ids"] for m in metrics] == [m["sample_ids"] for m in uninterrupted["metrics"]]


def test_the_survivor_trains_to_the_weights_of_the_uninterrupted_run(survivor_goes_on, uninterrupted):
    difference, worst = max_difference(survivor_goes_on["weights"], uninterrupted["weights"])
    assert difference <= WEIGHT_TOLERANCE, f"{worst}: max difference {difference:.3g} over {WEIGHT_TOLERANCE}"
    print(f"resumed at world size 2 against uninterrupted at 4: max weight difference {difference:.3g} ({worst})")


@pytest.fixture(scope="module")
def below_min(tiny_run, tmp_path_factory) -> dict:
    """num_nodes 2: the second agent killed after the first checkpoint; the survivor gives up, then both agents
    are started again (a retry once the node is back)."""
    root = tmp_path_factory.mktemp("fixed")
    out = root / "out"
    job = job_for(tiny_run, out, num_nodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}",
                  rdzv_join_timeout_s=JOIN_TIMEOUT_S)  # fmt: skip
    # the survivor's output where the train stage keeps it: launch_failed reads its last lines
    with agents_killed_at_exit(start_nodes(job, out, [out / LOG_FILE, root / "lost.log"])) as procs:
        killed_at = kill_after_first_checkpoint(procs, out)
        code = procs[0].wait(timeout=AGENT_TIMEOUT_S)
    newest = latest_complete(out)
    failure = launch_failed(code, out, started_from=None)
    logs = [root / "host-again.log", root / "lost-again.log"]
    with agents_killed_at_exit(start_nodes(job, out, logs)) as procs:
        codes = [p.wait(timeout=AGENT_TIMEOUT_S) for p in procs]
    again = logs[0].read_text() + logs[1].read_text()
    assert codes == [0, 0], again[-4000:]
    return {**finished(out), "code": code, "killed_at": killed_at, "newest": newest, "failure": failure,
            "resumes": resumed_from(again), "endpoint": job.train.rdzv_endpoint}  # fmt: skip


def test_below_min_nodes_the_survivor_gives_up_and_says_why(below_min):
    """The survivor exits non-zero once the rendezvous gave up (the guard is only a hang guard); eyas names the
    rendezvous as the reason, and the train task would relaunch: it got further and its cause may pass."""
    run, failure = below_min, below_min["failure"]
    assert run["code"] != 0
    message = str(failure)
    assert message.startswith(
        f"the rendezvous of train.num_nodes=2 at {run['endpoint']} failed: fewer than 2 nodes (its MIN) joined "
        f"within train.rdzv_join_timeout_s={JOIN_TIMEOUT_S} (torch's RendezvousTimeoutError: a node was lost and too "
        "few were left, or not all were started); start the agent of every missing node (the same command and "
        f"config on each) and retry: training resumes from {run['newest'].name}, the newest complete checkpoint "
        "once 2 nodes are back; or give train.num_nodes a lower MIN ('MIN:MAX') to go on with fewer; before that, "
        "training failed on rank "
    ), message
    assert "Connection" in message.split("; before that, ")[1]  # the ranks only saw their peers go
    assert failure.progressed and not failure.deterministic


def test_both_nodes_back_resume_from_the_newest_checkpoint_and_finish(below_min, uninterrupted):
    run = below_min
    step = int(run["newest"].name.removeprefix("step-"))
    assert run["resumes"] == [(step, 4, 4)] and step < STEPS
    state = run["state"]
    assert (state["step"], state["samples_consumed"], state["world_size"]) == (STEPS, STEPS * BATCH, 4)
    assert [m["step"] for m in run["metrics"]] == list(range(1, STEPS + 1))
    assert [m["sample_ids"] for m in run["metrics"]] == [m["sample_ids"] for m in uninterrupted["metrics"]]
    difference, worst = max_difference(run["weights"], uninterrupted["weights"])
    assert difference <= WEIGHT_TOLERANCE, f"{worst}: max difference {difference:.3g} over {WEIGHT_TOLERANCE}"
    print(f"relaunched at world size 4 against uninterrupted: max weight difference {difference:.3g} ({worst})")


RENDEZVOUS_TAIL = """  File ".../torch/distributed/elastic/rendezvous/dynamic_rendezvous.py", line 680, in run
    raise RendezvousTimeoutError
torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError
"""


def test_an_agent_that_gave_up_on_the_rendezvous_is_named_without_any_rank_record(tiny_run, tmp_path):
    """No rank recorded an exception (the agent gave up before its workers started): the rendezvous is the reason,
    and the log's last lines follow."""
    job_for(tiny_run, tmp_path, num_nodes="3:4", rdzv_endpoint="node-0", rdzv_join_timeout_s=900)
    (tmp_path / LOG_FILE).write_text("starting\n" + RENDEZVOUS_TAIL)
    message = str(launch_failed(1, tmp_path, started_from=None))
    assert message.startswith(
        "the rendezvous of train.num_nodes='3:4' at node-0:29400 failed: fewer than 3 nodes (its MIN) joined within "
        "train.rdzv_join_timeout_s=900 (torch's RendezvousTimeoutError: "
    ), message
    assert "training resumes from step 0 (no checkpoint yet) once 3 nodes are back; " in message
    assert "; torchrun exited with 1 and no rank recorded an exception (started from step 0, " in message
    assert message.endswith(RENDEZVOUS_TAIL)


def test_a_rendezvous_failure_of_an_earlier_launch_is_not_this_ones_reason(tiny_run, tmp_path):
    """train/torchrun.log gathers every launch: only its last lines (this launch's end) are read."""
    job_for(tiny_run, tmp_path, num_nodes=2, rdzv_endpoint="node-0")
    (tmp_path / LOG_FILE).write_text(RENDEZVOUS_TAIL + "an earlier launch ended\n" * 30 + "Killed\n")
    message = str(launch_failed(137, tmp_path, started_from=None))
    assert message.startswith("torchrun exited with 137 and no rank recorded an exception"), message
