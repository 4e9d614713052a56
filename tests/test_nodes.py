"""The node records of a training job (eyas.train.nodes): who writes them, which launch's nodes are shown, and when
a node counts as alive; and what `eyas status` says of them and of a stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eyas.status.nodes import job_summary, node_lines, stop_text
from eyas.train.nodes import (
    NODES_DIR,
    SILENT_AFTER_S,
    NodeRecorder,
    clear_stop,
    describe_node,
    job_nodes,
    read_node_records,
    read_stop,
    request_stop,
)
from eyas.train.preflight import process_start_time


def torchrun_env(node: int, *, local_rank: int = 0, per_node: int = 2, nodes: int = 2, restart: int = 0) -> dict:
    """The variables torchrun sets in a worker of node `node` (ranks numbered node by node)."""
    return {"GROUP_RANK": str(node), "LOCAL_RANK": str(local_rank), "RANK": str(node * per_node + local_rank),
            "LOCAL_WORLD_SIZE": str(per_node), "WORLD_SIZE": str(nodes * per_node),
            "TORCHELASTIC_RESTART_COUNT": str(restart), "TORCHELASTIC_RUN_ID": "job-7"}  # fmt: skip


def write_node(train_dir, node: int, launch: str, *, step: int = 3, state: str = "training", **env) -> dict:
    recorder = NodeRecorder(train_dir, launch, env=torchrun_env(node, **env))
    recorder.write(step, state)
    return json.loads(recorder.path.read_text())


def test_each_nodes_local_rank_0_records_host_ranks_world_and_step(tmp_path):
    record = write_node(tmp_path, 1, "L1", step=7)
    assert {k: record[k] for k in ("node_rank", "ranks", "world_size", "restart_count", "run_id", "step", "state")} == {
        "node_rank": 1, "ranks": [2, 3], "world_size": 4, "restart_count": 0, "run_id": "job-7", "step": 7,
        "state": "training",
    }  # fmt: skip
    assert record["pid"] == os.getpid() and record["launch_id"] == "L1"
    other_rank = NodeRecorder(tmp_path, "L1", env=torchrun_env(0, local_rank=1))
    other_rank.write(7, "training")
    assert not other_rank.path.exists()  # node 0's record comes from its local rank 0 only


def test_a_record_is_rewritten_only_when_due_or_after_another_state(tmp_path):
    recorder = NodeRecorder(tmp_path, "L1", env=torchrun_env(0), every_s=3600)
    recorder.write(1, "training")
    recorder.update(2)
    assert json.loads(recorder.path.read_text())["step"] == 1  # not due: no write
    recorder.write(5, "saving")
    recorder.update(5)
    assert json.loads(recorder.path.read_text())["state"] == "training"  # a save that ended is said at once


def test_only_the_newest_launchs_nodes_are_the_jobs(tmp_path):
    """A node of an earlier launch (another world: 3 nodes) and an elastic restart's earlier records are not this
    job's nodes, though their files are still there."""
    for node in range(3):
        write_node(tmp_path, node, "before-restart", nodes=3)
    write_node(tmp_path, 0, "after-restart", restart=1)
    write_node(tmp_path, 1, "after-restart", restart=1)
    found = job_nodes(tmp_path)
    assert found["launch_id"] == "after-restart" and found["ignored"] == 1
    assert [(n["node_rank"], n["restart_count"], n["world_size"]) for n in found["nodes"]] == [(0, 1, 4), (1, 1, 4)]
    assert len(read_node_records(tmp_path)) == 3


def test_a_node_silent_for_longer_than_the_bound_is_not_alive(tmp_path):
    record = write_node(tmp_path, 0, "L1", step=9)
    found = job_nodes(tmp_path, now=record["written_at"] + SILENT_AFTER_S + 12)
    node = found["nodes"][0]
    assert not node["alive"] and node["why"] == f"not seen for {SILENT_AFTER_S + 12:.0f} s (last training at step 9)"
    assert job_nodes(tmp_path, now=record["written_at"] + 1)["nodes"][0]["alive"]


def test_a_node_on_this_host_whose_process_is_gone_is_not_alive(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        recorder = NodeRecorder(tmp_path, "L1", env=torchrun_env(0))
        recorder.record |= {"pid": proc.pid, "process_start": process_start_time(proc.pid)}  # as if it wrote
        recorder.write(4, "training")
        assert job_nodes(tmp_path)["nodes"][0]["alive"]
    finally:
        proc.kill()
        proc.wait()
    node = job_nodes(tmp_path)["nodes"][0]
    assert not node["alive"] and node["why"] == f"process {proc.pid} is gone (last training at step 4)"
    assert job_nodes(tmp_path, host="another-host")["nodes"][0]["alive"]  # another host's pid is not looked up


def test_a_stopped_node_is_listed_not_alive_with_its_step(tmp_path):
    write_node(tmp_path, 0, "L1", step=12, state="stopped")
    write_node(tmp_path, 1, "L1", step=12, state="stopped")
    summary = job_summary(tmp_path)
    assert summary["alive"] == 0 and [n["why"] for n in summary["nodes"]] == ["stopped at step 12"] * 2
    lines = node_lines({"nodes": summary})
    assert lines[0] == "nodes of the last launch: none alive"
    assert lines[2] == f"  node 1 on {summary['nodes'][1]['host']} (ranks 2-3 of 4, pid {os.getpid()}): step 12, " + (
        "stopped at step 12"
    )
    assert describe_node(summary["nodes"][0]).startswith("node 0 on ")


def test_a_damaged_node_record_is_named_with_the_fix(tmp_path):
    (tmp_path / NODES_DIR).mkdir()
    (tmp_path / NODES_DIR / "node-000.json").write_text("{")
    with pytest.raises(ValueError, match=r"node record .*node-000.json: not JSON .*; delete it, the node writes it"):
        job_nodes(tmp_path)


def test_a_stop_request_names_who_asked_and_a_launch_clears_it(tmp_path):
    request = request_stop(tmp_path, now=0)
    assert read_stop(tmp_path) == request and request["requested_at"] == "1970-01-01T00:00:00+00:00"
    assert stop_text(request) == (
        f"a stop was requested by {request['requested_by']} on {request['host']} at 1970-01-01T00:00:00+00:00; the "
        "ranks stop after their current step"
    )
    assert stop_text({**request, "stopped_at_step": 1200}).startswith("stopped by `eyas stop` at step 1,200 (")
    clear_stop(tmp_path)
    assert read_stop(tmp_path) is None


def test_a_stop_with_no_job_running_says_the_next_launch_clears_it(tmp_path, capsys):
    from eyas_cli.main import main

    write_node(tmp_path, 0, "L1", step=40, state="finished")  # the last launch ended
    assert main(["stop", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"stop requested in {tmp_path / 'stop.json'}: every rank of the job, on every node,")
    assert out[1:3] == [
        f"no process recorded in {tmp_path} is running",
        f"no job was found running: no node recorded in {tmp_path / NODES_DIR} was seen training in the last "
        f"{SILENT_AFTER_S:.0f} s; the request stays until the next launch, which clears it when it starts (a launch "
        "never starts stopped)",
    ]
    assert read_stop(tmp_path)["requested_by"]
