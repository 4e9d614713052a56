"""The producer of a streamed run as a Prefect task: extraction in the order the trainer first needs the shards,
each shard verified as it commits (eyas.extract.streamed), its progress in a progress artifact."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas.config import RunConfig
from eyas.extract.plan import describe_extraction
from eyas.extract.streamed import run_streamed_extraction
from eyas.facts import RunFacts
from eyas.train.nodes import request_stop
from eyas.train.stream_order import stream_order
from tasks.reporting import StageProgress
from tasks.retry import TRANSIENT_IO


def trainer_order(config: RunConfig, facts: RunFacts) -> list[int]:
    """Every planned shard once, in the order the training run first reads it (eyas.train.stream_order)."""
    _, plan = describe_extraction(config.extract, facts, target_dtype=config.target.dtype)
    return list(stream_order(plan, config.train, num_samples=facts.num_samples).shards)


# Not cached: the manifest rows and verdicts are its durable record. Storage errors retried; a retry resumes
# (eyas.extract.streamed): a committed, verified shard is neither extracted nor checked again.
@task(name="extract-stream", cache_policy=NO_CACHE, **TRANSIENT_IO)
def extract_stream(config: RunConfig, facts: RunFacts, only: list[int] | None = None) -> dict:
    """Extract the planned shards in the trainer's first-need order, verifying each as it commits (`only`: these
    shards alone, e.g. the smoke run's)."""
    title = "extracting and verifying hidden states" + (f" (shards {only})" if only is not None else "")
    with StageProgress("extract-stream-progress", title, "samples_done", "samples_total") as progress:
        summary = run_streamed_extraction(
            config,
            facts,
            shard_order=trainer_order(config, facts),
            target_dtype=config.target.dtype,
            progress=progress,
            only=only,
        )
    return summary.to_dict()


def smoke_shards(config: RunConfig, facts: RunFacts) -> list[int]:
    """The planned shards holding the first smoke.num_samples samples: those the smoke run reads."""
    _, plan = describe_extraction(config.extract, facts, target_dtype=config.target.dtype)
    return [p.index for p in plan if p.sample_start < config.smoke.num_samples]


def stop_training(config: RunConfig) -> None:
    """Ask the run's trainer to stop at its next step, as `eyas stop` does (eyas.train.nodes.request_stop), and say
    why: its producer failed."""
    request_stop(config.paths.train_dir)
    print(
        f"extraction failed: the trainer in {config.paths.train_dir} was asked to stop at its next step (a checkpoint "
        "there); a rank waiting for a shard says which in its log; run the pipeline again to resume both"
    )
