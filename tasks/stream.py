"""The producer of a streamed run as a Prefect task: extraction in the order the trainer first needs the shards,
each shard verified as it commits (eyas.extract.streamed), its progress in a progress artifact."""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture

from eyas.config import RunConfig
from eyas.extract.streamed import run_streamed_extraction
from eyas.facts import RunFacts
from eyas.shards.format import extraction_plan
from eyas.shards.retention import RetentionWindow
from eyas.train.preflight import stop_job
from eyas.train.shard_use import shard_use, trained_through
from eyas.train.stream_order import stream_order
from tasks.reporting import StageProgress, StreamSides
from tasks.retry import TRANSIENT_IO

STOP_POLL_S = 5.0  # between stop requests while the launch task has not ended


def trainer_order(config: RunConfig, facts: RunFacts) -> list[int]:
    """Every planned shard once, in the order the training run first reads it (eyas.train.stream_order)."""
    plan = extraction_plan(config.extract, facts)
    return list(stream_order(plan, config.train, num_samples=facts.num_samples).shards)


# Not cached: the manifest rows and verdicts are its durable record. Storage errors retried; a retry resumes
# (eyas.extract.streamed): a committed, verified shard is neither extracted nor checked again.
@task(name="extract-stream", cache_policy=NO_CACHE, **TRANSIENT_IO)
def extract_stream(config: RunConfig, facts: RunFacts, only: list[int] | None = None) -> dict:
    """Extract the planned shards in the trainer's first-need order, verifying each as it commits (`only`: these
    shards alone, e.g. the smoke run's)."""
    title = "extracting and verifying hidden states" + (f" (shards {only})" if only is not None else "")
    with StageProgress("extract-stream-progress", title, "samples_done", "samples_total") as bar:
        progress = StreamSides(config.paths.train_dir, bar)  # the trainer's side too, once it has written its job
        summary = run_streamed_extraction(
            config,
            facts,
            shard_order=trainer_order(config, facts),
            target_dtype=config.target.dtype,
            progress=progress,
            only=only,
            retention=retention_window(config, facts),
        )
    return summary.to_dict()


def retention_window(config: RunConfig, facts: RunFacts) -> RetentionWindow | None:
    """extract.retention = N: the window the producer writes into, releasing each shard once the trainer's newest
    complete checkpoint (in train_dir, shared with the trainer) is past its last use; None for 'keep'. A window too
    small for the stretch between two checkpoints is refused here, before the gate (with the smoke's shards)."""
    size = config.extract.retention
    if size == "keep":
        return None
    use = shard_use(extraction_plan(config.extract, facts), config.train, num_samples=facts.num_samples)
    train_dir = config.paths.train_dir
    return RetentionWindow(facts.storage(), use, size=size, mode=config.verify.mode,
                           trained_through=lambda: trained_through(train_dir))  # fmt: skip


def smoke_shards(config: RunConfig, facts: RunFacts) -> list[int]:
    """The planned shards holding the first smoke.num_samples samples: those the smoke run reads."""
    return [p.index for p in extraction_plan(config.extract, facts) if p.sample_start < config.smoke.num_samples]


def stop_training(config: RunConfig, training: PrefectFuture) -> None:
    """Stop the run's trainer as `eyas stop` does (eyas.train.preflight.stop_job: every rank stops after the same
    step with a checkpoint there; a launcher still alive after the wait is signalled, e.g. one whose ranks wait for a
    shard that no producer will write), again until the `training` launch task has ended: a launch that started
    after a request cleared it."""
    print(
        f"extraction failed: stopping the trainer in {config.paths.train_dir} (its checkpoints are kept; run the "
        "pipeline again to resume extraction and training)"
    )
    config.paths.train_dir.mkdir(parents=True, exist_ok=True)  # a launch that has not begun has not made it yet
    while not training.state.is_final():
        stop_job(config.paths.train_dir)
        training.wait(timeout=STOP_POLL_S)


# Each start of the producer deployment: a run that ends Crashed (its machine or process died; the crash
# automation marks a dead machine's run so, eyas_cli/automation.py) is followed by another that resumes it.
PRODUCER_RUNS = 3
PRODUCER_POLL_S = 2.0


def producer_run(config: RunConfig, facts: RunFacts, attempt: int):
    """Start one flow run of extract.stream_deployment on the pipeline's config and facts (not waiting for it)."""
    from prefect.context import get_run_context
    from prefect.deployments import run_deployment

    parent = get_run_context().flow_run
    return run_deployment(
        config.extract.stream_deployment,
        parameters={"config": config.model_dump(mode="json"), "facts": facts.model_dump(mode="json")},
        timeout=0,
        idempotency_key=f"{parent.id}-{parent.run_count}-extract-stream-{attempt}",  # a pipeline retry starts anew
    )


def follow_producer(config: RunConfig, facts: RunFacts, *, poll_s: float = PRODUCER_POLL_S) -> dict:
    """The producer as flow runs of extract.stream_deployment: wait for each; one that ended Crashed is followed by
    a new one (which resumes from the manifest and verdicts), up to PRODUCER_RUNS; one that Failed or was Cancelled,
    or the last Crashed one, raises with its name, state and message."""
    from prefect.client.orchestration import get_client

    deployment = config.extract.stream_deployment
    for attempt in range(1, PRODUCER_RUNS + 1):
        run = producer_run(config, facts, attempt)
        print(f"producer: flow run {run.name} ({run.id}) of {deployment} (start {attempt} of {PRODUCER_RUNS})")
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(run.id).state
            while state is None or not state.is_final():
                time.sleep(poll_s)
                state = client.read_flow_run(run.id).state
        if state.is_completed():
            print(f"producer: flow run {run.name} Completed")
            return {"flow_run": run.name, "state": state.name}
        if not state.is_crashed() or attempt == PRODUCER_RUNS:
            break
        print(f"producer: flow run {run.name} ended Crashed ({state.message}); the trainer waits for its shards; "
              f"starting another run of {deployment}, which resumes what is committed")  # fmt: skip
    raise RuntimeError(
        f"extract-stream flow run {run.name} ({run.id}) of {deployment} ended {state.name}: {state.message} "
        f"(start {attempt} of {PRODUCER_RUNS}); its committed, verified shards are kept; fix the cause and run the "
        "pipeline again, it resumes extraction and training"
    )
