"""A streamed run's two sides on "different machines": the producer as flow runs of a served `extract-stream`
deployment (a process of its own, tests/stream_deployment_side.py), the trainer in the pipeline's run (torchrun,
gloo ranks, reading the S3 server through its cache); they share only the S3 server and the Prefect server. The
serving process is SIGKILLed mid-run; the pipeline learns that its run ended Crashed (marked here as the crash
automation marks a dead machine's runs, eyas_cli/automation.py), starts a new one once the deployment is served
again, and the trainer, which waited, ends with the weights of an offline training on the same shards, bit for
bit. The trainer's kill is tested where both sides are processes alone (tests/test_stream_kills.py)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from run_fixtures import REPO, write_tokenized
from run_queries import logs
from safetensors.torch import load_file
from torchrun_agents import run_agents

from eyas.config import DraftConfig, load_run_config
from eyas.dataset.vocab import build_vocab
from eyas.facts import facts_for
from eyas.shards.manifest import read_manifest
from eyas.storage import open_storage
from eyas.train.checkpoint import latest_complete
from eyas.train.launch import JOB_FILE, train_job, write_train_job

NAME = "stream-test"
NUM_SAMPLES = 40
HOLD_AFTER = 2  # shard files the first producer run writes before its writes are held (and it is killed)
LIMIT_S = 120.0  # a bound against hanging, not a measure of speed


def streamed_config(root: Path, target: Path, bucket: str, endpoint: str):
    """The tiny random target's run, streamed, its shards on S3 read through a cache, the producer a deployment."""
    base = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    return base.model_copy(update={
        "workdir": str(root),
        "target": base.target.model_copy(update={"model_path": str(target)}),
        "dataset": base.dataset.model_copy(update={"draft_vocab_size": 256}),
        "extract": base.extract.model_copy(update={
            "shard_bytes": 1 << 16, "batch_size": 8, "num_workers": 1, "storage_url": f"s3://{bucket}/shards",
            "s3_endpoint_url": endpoint, "stream_deployment": f"extract-stream/{NAME}"}),
        "draft": DraftConfig(num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
                             max_position_embeddings=64),
        "train": base.train.model_copy(update=dict(
            start="streaming", num_processes=2, global_batch_size=4, shuffle_window_shards=2, num_epochs=2, lr=1e-2,
            num_warmup_steps=1, num_ttt_steps=2, save_every_steps=2, cache_bytes=4 << 16, prefetch_steps=1)),
    })  # fmt: skip


class Producer:
    """The deployment served by a process group of its own (its flow runs are its children)."""

    def __init__(self, log: Path, hold: str = ""):
        env = {**os.environ, "PREFECT_RUNNER_POLL_FREQUENCY": "1", "EYAS_TEST_HOLD": hold}
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "stream_deployment_side.py"), NAME],
                                         cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)


def wait_until(condition, what: str):
    deadline = time.monotonic() + LIMIT_S
    while not (found := condition()):
        assert time.monotonic() < deadline, f"not within {LIMIT_S:.0f} s: {what}"
        time.sleep(0.2)
    return found


def registered() -> bool:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_deployment_by_name(f"extract-stream/{NAME}") is not None
        except ObjectNotFound:  # until the runner has registered it
            return False


def kill_the_producer_mid_run(store, log: Path, seen: dict) -> None:
    """Once the first producer run has written its shards before the hold: SIGKILL its serving process group, mark
    the run Crashed as the crash automation would (no heartbeat reaches the server any more), serve again."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.states import Crashed

    def producer_runs():
        with get_client(sync_client=True) as client:
            try:
                deployment = client.read_deployment_by_name(f"extract-stream/{NAME}")
            except Exception:  # ObjectNotFound until the runner has registered it
                return []
            only = FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment.id]))
            return client.read_flow_runs(flow_run_filter=only)

    [run] = wait_until(producer_runs, "the first producer run started")
    wait_until(lambda: len([n for n in store.list("") if n.endswith(".safetensors")]) >= HOLD_AFTER,
               f"{HOLD_AFTER} shard files written")  # fmt: skip
    seen["producer"].kill()
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Crashed(message="no heartbeat (the serving process was killed)"), force=True)
    seen["killed"] = run.name
    seen["producer"] = Producer(log)


@pytest.mark.timeout(600)
def test_a_killed_producer_deployment_is_started_again_and_the_trainer_ends_as_offline(
    prefect_server, random_target_dir, s3_endpoint, s3_bucket, tmp_path
):
    from prefect import flow

    from flows.pipeline import train_while_extracting

    config = streamed_config(tmp_path / "streamed", random_target_dir, s3_bucket, s3_endpoint)
    rng = random.Random(5)
    samples = [[rng.randrange(1, 2048) for _ in range(rng.randint(4, 16))] for _ in range(NUM_SAMPLES)]
    config.paths.dataset_dir.mkdir(parents=True)
    write_tokenized(config.paths.tokenized, samples)
    build_vocab(config)
    facts = facts_for(target_path=random_target_dir, tokenized_path=config.paths.tokenized,
                      storage_url=config.extract.storage_url, s3_endpoint_url=s3_endpoint)  # fmt: skip
    store = open_storage(config.extract.storage_url, endpoint_url=s3_endpoint)

    @flow(name="pipeline-after-gate", log_prints=True)  # as the pipeline
    def after_gate() -> str:
        train_while_extracting(config, config, facts)
        from prefect.context import get_run_context

        return str(get_run_context().flow_run.id)

    log = tmp_path / "serve.log"
    seen = {"workdir": config.workdir, "producer": Producer(log, hold=f"{HOLD_AFTER}:{tmp_path / 'never'}")}
    wait_until(lambda: registered(), f"extract-stream/{NAME} served")  # before the pipeline asks for a run of it
    killer = threading.Thread(target=kill_the_producer_mid_run, args=(store, log, seen), daemon=True)
    killer.start()
    try:
        state = after_gate(return_state=True)
    finally:
        killer.join(timeout=30)
        seen["producer"].stop()
    assert state.is_completed(), f"{state.message}\n{log.read_text()[-4000:]}"
    said = logs(state.state_details.flow_run_id)
    crashed = [m for m in said if m.startswith(f"producer: flow run {seen['killed']} ended Crashed")]
    assert crashed and "the trainer waits for its shards" in crashed[0], said
    assert any(m.startswith("producer: flow run ") and m.endswith(" Completed") for m in said), said

    offline = config.model_copy(update={"workdir": str(tmp_path / "offline"),
                                        "train": config.train.model_copy(update={"start": "offline"})})  # fmt: skip
    offline.paths.vocab.parent.mkdir(parents=True)
    shutil.copyfile(config.paths.vocab, offline.paths.vocab)
    job = write_train_job(train_job(offline, facts), offline.paths.train_dir / JOB_FILE)
    run_agents([[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                 "eyas.train", "--config", str(job)]], [tmp_path / "offline.log"])  # fmt: skip
    a = load_file(latest_complete(config.paths.train_dir) / "model.safetensors")
    b = load_file(latest_complete(offline.paths.train_dir) / "model.safetensors")
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert len(read_manifest(store)) > HOLD_AFTER
