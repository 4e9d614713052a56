"""The further nodes of a training on several nodes (train.num_nodes above 1) and what the first node does for them.

    config = with_rendezvous_at(config, address_towards(prefect_api_host))  # rdzv_endpoint left empty: this node
    summary = node_agent_run(config, facts, node_index=1)                   # on a further node: its torchrun agent

Every node runs the same torchrun command (eyas.train.launch.torchrun_command) on the same job file in the shared
train directory; torch's c10d rendezvous gathers the agents and its elastic agent restarts them. The first node (the
training flow's own machine) writes the job file and starts the further nodes (as flow runs of the `train-node`
deployment, tasks/train.py); a further node checks that the job file is the job its own config gives, so a node
launched with another config (another checkout, another shard set) stops before it joins. Global rank 0, which
writes metrics.jsonl and the checkpoints, may be on any node (torch ranks the nodes in the order of their
descriptors), so the first node follows metrics.jsonl rather than its own agent's output (eyas.train.metrics.MetricsFollower).
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

from eyas.config import RunConfig
from eyas.facts import RunFacts

JOB_WAIT_S = 600  # a further node started before the first node wrote the job file waits this long for it


def address_towards(host: str) -> str:
    """The address of this machine on the route to `host`: the one the machines that reach `host` (the Prefect
    server) are likeliest to reach this one by. Nothing is sent: connecting a UDP socket only picks the route."""
    family, _, _, _, where = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(where)
        return s.getsockname()[0]


def with_rendezvous_at(config: RunConfig, host: str) -> RunConfig:
    """The run's config with train.rdzv_endpoint at `host` (this node, at torch's c10d port) when the run trains on
    several nodes and left the endpoint empty for the flow to fill; otherwise the config as it is."""
    train = config.train
    if train.num_nodes == 1 or train.rdzv_endpoint:
        return config
    data = config.model_dump(mode="json")
    data["train"]["rdzv_endpoint"] = f"[{host}]" if ":" in host else host
    return RunConfig.model_validate(data)


def further_nodes(config: RunConfig) -> list[int]:
    """The node indexes the first node starts agents for: 1..MAX-1 (a range's extra nodes join when they can)."""
    return list(range(1, config.train.node_range[1]))


def node_log_path(train_dir: Path, node_index: int) -> Path:
    return Path(train_dir) / f"torchrun-node-{node_index}.log"


def node_agent_run(config: RunConfig, facts: RunFacts, node_index: int, *, job_wait_s: float = JOB_WAIT_S) -> dict:
    """Run a further node's torchrun agent on the job file the first node wrote; its output goes to
    train/torchrun-node-K.log. Returns {node_index, host, returncode}; raises when the agent fails."""
    from eyas.train.launch import JOB_FILE, format_command, torchrun_command, train_job
    from eyas.train.preflight import record_launch

    train_dir = config.paths.train_dir
    if config.train.num_nodes == 1 or not config.train.rdzv_endpoint:
        raise ValueError(
            f"node {node_index}: train.num_nodes={config.train.num_nodes!r}, train.rdzv_endpoint="
            f"{config.train.rdzv_endpoint!r}: a further node needs several nodes and the first node's rendezvous "
            "endpoint; start it from the training flow (train.node_deployment), which fills in the endpoint"
        )
    job_path = train_dir / JOB_FILE
    wait_for_job(job_path, train_job(config, facts).model_dump_json(indent=2), node_index, job_wait_s)
    cmd = torchrun_command(config, job_path)
    log_path = node_log_path(train_dir, node_index)
    print(f"node {node_index} on {socket.gethostname()}: joining the rendezvous at {config.train.rdzv_endpoint}")
    print(f"launching: {format_command(cmd)} (output in {log_path})")
    with open(log_path, "a") as log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                      start_new_session=True) as proc:  # fmt: skip
        record_launch(train_dir, proc.pid, cmd)
        returncode = proc.wait()
    if returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-20:])
        raise RuntimeError(
            f"node {node_index}'s torchrun agent on {socket.gethostname()} exited with {returncode}; the job's "
            f"failure is reported by the training flow (train/torchrun.log, train/failures/); last lines of "
            f"{log_path}:\n{tail}"
        )
    return {"node_index": node_index, "host": socket.gethostname(), "returncode": returncode}


def wait_for_job(job_path: Path, expected: str, node_index: int, wait_s: float) -> None:
    """Wait until the first node's job file exists, then check it is this node's job."""
    deadline = time.monotonic() + wait_s
    while not job_path.is_file():
        if time.monotonic() > deadline:
            raise FileNotFoundError(
                f"node {node_index}: no job file at {job_path} after {wait_s:.0f} s: the first node writes it before "
                "it starts the further nodes; is the train directory on storage both machines share (the same path)?"
            )
        time.sleep(1.0)
    found = job_path.read_text()
    if found != expected:
        ours, theirs = json.loads(expected), json.loads(found)
        differing = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        raise ValueError(
            f"node {node_index}: {job_path} is another job than this node's config gives (differing: "
            f"{', '.join(differing)}): every node must train the same job from the same paths; start this node "
            "with the first node's config, on the same shared storage paths"
        )
