"""The training flow on several nodes (train.num_nodes, train.node_deployment) against a real Prefect server: the
first node's launch task starts each further node as a flow run of a served `train-node` deployment (the
run_deployment call a GPU work pool answers), both agents meet at torch's c10d rendezvous on loopback, and the job
trains to the weights one node of as many processes reaches, bit for bit; the first node follows metrics.jsonl,
since global rank 0 may be on either node. And what a further node refuses: another job than its config gives."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from run_fixtures import AUX_LAYER_IDS, tiny_job, write_tiny_run
from run_queries import logs, run_tree
from safetensors.torch import load_file
from torchrun_agents import free_port, run_agents

from eyas.config import RunConfig, TrainJob, load_run_config
from eyas.facts import RunFacts
from eyas.train.checkpoint import latest_complete, read_trainer_state
from eyas.train.launch import JOB_FILE, torchrun_launcher, train_job, write_train_job
from eyas.train.node_agents import address_towards, node_agent_run, with_rendezvous_at

REPO = Path(__file__).resolve().parents[1]
STEPS = 4
DEPLOYMENT = "train-node/nodes-test"


def node_run_config(workdir: Path, run: dict, **train) -> RunConfig:
    """The tiny preset training the synthetic run in `workdir`: a small draft, 1 epoch of STEPS steps."""
    data = load_run_config(REPO / "deployments" / "tiny-cpu.json").model_dump(mode="json")
    data["workdir"] = str(workdir)
    data["target"]["model_path"] = str(run["target"])
    data["draft"].update(num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
                         max_position_embeddings=64)  # fmt: skip
    data["train"].update({"num_processes": 1, "num_epochs": 1, "max_steps": STEPS, "global_batch_size": 8,
                          "save_every_steps": 2, "lr": 1e-2, "num_warmup_steps": 1, "num_ttt_steps": 3,
                          "eval_fraction": 0.0, **train})  # fmt: skip
    config = RunConfig.model_validate(data)
    config.paths.vocab.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run["vocab"], config.paths.vocab)
    return config


def facts_of(run: dict) -> RunFacts:
    target = json.loads((run["target"] / "config.json").read_text())
    return RunFacts(
        target={"model_path": str(run["target"]), "num_layers": target["num_hidden_layers"],
                "hidden_size": target["hidden_size"], "vocab_size": target["vocab_size"], "fingerprint": "f"},
        aux_layer_ids=AUX_LAYER_IDS,
        tokenized_path="unused",
        dataset_hash="synthetic",
        num_samples=len(run["samples"]),
        shards_dir=str(run["shards"]),
        storage_url=str(run["shards"]),
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    return write_tiny_run(tmp_path_factory.mktemp("nodes-run"), num_samples=32)


@pytest.fixture
def served_node_deployment(prefect_server, tmp_path):
    """`train-node/nodes-test` served by a runner process (each flow run in a process of its own)."""
    from prefect.client.orchestration import get_client

    serve = "from flows.train import train_node_flow; train_node_flow.serve(name='nodes-test', limit=2)"
    env = {**os.environ, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        runner = subprocess.Popen([sys.executable, "-c", serve], cwd=REPO, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        with get_client(sync_client=True) as client:
            while True:
                try:
                    client.read_deployment_by_name(DEPLOYMENT)
                    break
                except Exception as e:  # ObjectNotFound until the runner has registered it
                    if runner.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the runner did not serve {DEPLOYMENT}: {log_path.read_text()}") from e
                    time.sleep(0.5)
        yield
    finally:
        runner.terminate()
        runner.wait(timeout=30)


def test_the_flow_starts_the_further_node_and_trains_as_one_node_would(
    prefect_server, served_node_deployment, tiny_run, tmp_path
):
    from prefect.client.orchestration import get_client

    from flows.train import train_flow

    endpoint = f"127.0.0.1:{free_port()}"
    config = node_run_config(tmp_path / "two", tiny_run, num_nodes=2, node_deployment=DEPLOYMENT,
                             rdzv_endpoint=endpoint, rdzv_join_timeout_s=120)  # fmt: skip
    facts = facts_of(tiny_run)
    state = train_flow(config, facts, require_approval=False, return_state=True)
    assert state.is_completed(), state.message
    train_dir = config.paths.train_dir
    checkpoint = latest_complete(train_dir)
    assert checkpoint.name == f"step-{STEPS:08d}" and read_trainer_state(checkpoint)["world_size"] == 2

    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        runs = [client.read_flow_run(run_id) for run_id in run_tree(flow_run_id)]
    nodes = [r for r in runs if r.deployment_id is not None]
    assert [(r.parameters["node_index"], r.state.name) for r in nodes] == [(1, "Completed")]
    assert nodes[0].parameters["config"]["train"]["rdzv_endpoint"] == endpoint
    assert "[eyas.train]" in (train_dir / "torchrun-node-1.log").read_text()
    progress = [m for m in logs(flow_run_id) if m.startswith("training; step ")]  # followed from metrics.jsonl
    assert progress and progress[-1].startswith(f"training; step {STEPS}/{STEPS}; loss "), progress
    assert any(m.startswith(f"node 1: flow run {nodes[0].id} Completed") for m in logs(flow_run_id))

    one = node_run_config(tmp_path / "one", tiny_run, num_processes=2)  # one node of as many processes
    job_path = write_train_job(train_job(one, facts), one.paths.train_dir / JOB_FILE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "eyas.train",
           "--config", str(job_path)]  # fmt: skip
    run_agents([cmd], [tmp_path / "one.log"])
    a = load_file(checkpoint / "model.safetensors")
    b = load_file(latest_complete(one.paths.train_dir) / "model.safetensors")
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_an_empty_endpoint_becomes_this_nodes_address_towards_the_server(tiny_run, tmp_path):
    config = node_run_config(tmp_path, tiny_run, num_nodes="1:2", node_deployment=DEPLOYMENT)
    assert config.train.rdzv_endpoint == ""
    filled = with_rendezvous_at(config, address_towards("127.0.0.1"))
    assert filled.train.rdzv_endpoint == "127.0.0.1:29400"
    given = node_run_config(tmp_path, tiny_run, num_nodes=2, node_deployment=DEPLOYMENT, rdzv_endpoint="10.1.2.3")
    assert with_rendezvous_at(given, "127.0.0.1").train.rdzv_endpoint == "10.1.2.3:29400"  # a given one is kept
    with pytest.raises(ValueError, match="train.rdzv_endpoint is empty with train.num_nodes=2: .* set train.node_dep"):
        node_run_config(tmp_path, tiny_run, num_nodes=2)
    with pytest.raises(ValueError, match=r"train.node_deployment='extract-worker/x': expected 'train-node/NAME'"):
        node_run_config(tmp_path, tiny_run, num_nodes=2, node_deployment="extract-worker/x")


def test_a_further_node_refuses_another_job_than_its_config_gives(tiny_run, tmp_path):
    config = node_run_config(tmp_path, tiny_run, num_nodes=2, rdzv_endpoint="127.0.0.1:1")
    facts = facts_of(tiny_run)
    other = node_run_config(tmp_path, tiny_run, num_nodes=2, rdzv_endpoint="127.0.0.1:1", lr=5e-3)
    write_train_job(train_job(other, facts), config.paths.train_dir / JOB_FILE)
    with pytest.raises(ValueError, match=r"node 1: .*job.json is another job than this node's config gives "
                                         r"\(differing: train\): every node must train the same job"):  # fmt: skip
        node_agent_run(config, facts, 1, job_wait_s=0)
    (config.paths.train_dir / JOB_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="node 1: no job file at .* the first node writes it before"):
        node_agent_run(config, facts, 1, job_wait_s=0)


def test_each_nodes_ranks_read_through_caches_on_their_own_disk(tiny_run, s3_endpoint, s3_bucket, tmp_path):
    """Shards on S3, train.cache_dir a node-local path: 2 agents x 1 process train to the weights one agent of 2
    reaches from the local shard copy, bit for bit, each rank's cache in the run's folder under cache_dir (none in
    the shared output directory); the checkpoints rank 0 writes to the shared directory are what both restore."""
    from eyas.storage.s3 import S3Storage
    from eyas.train.setup import CACHE_DIR

    store = S3Storage(f"s3://{s3_bucket}/shards", endpoint_url=s3_endpoint)
    for path in sorted(p for p in Path(tiny_run["shards"]).rglob("*") if p.is_file()):  # as extraction leaves it
        store.put_bytes(str(path.relative_to(tiny_run["shards"])), path.read_bytes())
    largest = max(p.stat().st_size for p in Path(tiny_run["shards"]).rglob("*.safetensors"))
    common = {"num_epochs": 1, "max_steps": STEPS, "global_batch_size": 8, "save_every_steps": 2,
              "shuffle_window_shards": 1}  # fmt: skip

    def job_file(root: Path, **train) -> Path:
        job = tiny_job(tiny_run, root / "out", **common, **train)
        if train.get("cache_bytes"):
            job = job.model_copy(update={"shards_dir": store.url, "shards_endpoint_url": s3_endpoint})
        path = root / "job.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(job.model_dump_json())
        return path

    local = tmp_path / "local-disk"
    nodes = job_file(tmp_path / "nodes", num_processes=1, num_nodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}",
                     cache_bytes=2 * largest, cache_dir=str(local))  # fmt: skip
    cmd = [*torchrun_launcher(TrainJob.model_validate_json(nodes.read_text()).train, rdzv_id="eyas-test-caches"),
           "-m", "eyas.train", "--config", str(nodes)]  # fmt: skip
    run_agents([cmd, cmd], [tmp_path / "node-0.log", tmp_path / "node-1.log"])
    one = job_file(tmp_path / "one", num_processes=2)
    run_agents([[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                 "eyas.train", "--config", str(one)]], [tmp_path / "one.log"])  # fmt: skip

    a = load_file(latest_complete(tmp_path / "nodes" / "out") / "model.safetensors")
    b = load_file(latest_complete(tmp_path / "one" / "out") / "model.safetensors")
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []
    [run_cache] = local.iterdir()
    assert sorted(p.name for p in run_cache.iterdir()) == ["rank-0", "rank-1"]
    assert all(any(d.iterdir()) for d in run_cache.iterdir())  # each rank's cache held shards
    assert not (tmp_path / "nodes" / "out" / CACHE_DIR).exists()


def test_a_cache_dir_without_a_cache_or_not_absolute_is_refused():
    from eyas.config import TrainConfig

    with pytest.raises(ValueError, match=r"train.cache_dir='/nvme/c' would do nothing: train.cache_bytes=0 trains "):
        TrainConfig(cache_dir="/nvme/c")
    with pytest.raises(ValueError, match=r"train.cache_dir='nvme/c': expected an absolute directory \(each node"):
        TrainConfig(cache_dir="nvme/c", cache_bytes=1 << 30)


def test_another_hosts_launcher_in_the_shared_registry_is_not_this_hosts(tmp_path):
    """On several nodes the train directory's registry is shared: a PID recorded by another host is never taken for
    a process of this one (which `eyas stop` would signal)."""
    import json

    from eyas.train.preflight import REGISTRY, alive_recorded, record_launch

    record_launch(tmp_path, os.getpid(), ["this", "process"])
    entries = json.loads((tmp_path / REGISTRY).read_text())
    (tmp_path / REGISTRY).write_text(json.dumps([*entries, {**entries[0], "host": "another-node"}]))
    assert [(e["pid"], e["host"]) for e in alive_recorded(tmp_path)] == [(os.getpid(), entries[0]["host"])]
