"""Tasks of the training stage: smoke run, device preflight, the torchrun launch with live metrics.

A failed launch is relaunched automatically only if it got further (see `relaunch_if_progressed`);
the launch itself, and what "further" means, is eyas.train.launch."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas.config import RunConfig
from eyas.facts import RunFacts
from eyas.train.launch import TorchrunFailed, planned_steps, train_run
from eyas.train.metrics import METRICS_FILE, read_metrics
from eyas.train.preflight import preflight_run
from eyas.train.smoke import smoke_run as run_smoke
from tasks.caching import cached_by
from tasks.reporting import StageProgress, png_artifact
from tasks.retry import failure_of, log_to_run

MAX_RELAUNCHES = 2


def relaunch_if_progressed(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn` of the launch: relaunch (resuming from the newest checkpoint) only a
    trainer that wrote a newer complete checkpoint before it failed. Progress means the failure came
    later than the last one (a node or network hiccup, a preempted GPU); a trainer that fails again
    before its next checkpoint would fail the same way on every relaunch (bad data, out of memory at a
    given step, a bug), so it stops the run with the log instead of burning GPU-hours."""
    exc = failure_of(state)
    relaunch = isinstance(exc, TorchrunFailed) and exc.progressed
    if isinstance(exc, TorchrunFailed):
        log_to_run(
            f"{task.name}: trainer failed after reaching {exc.newest.name if exc.newest else 'no checkpoint'} "
            f"(started from {exc.started_from.name if exc.started_from else 'step 0'}): "
            + ("relaunching, it resumes from there" if relaunch else "no progress, not relaunched")
        )
    return relaunch


# Cached by the shards (manifest), vocab and tokenized table and the config sections it trains with. Not
# retried: compute on local files, and a loss that does not fall is deterministic.
@task(
    name="smoke-run",
    **cached_by(
        ("target", "dataset", "extract", "draft", "train", "smoke"), ("tokenized", "vocab", "manifest", "shard_files")
    ),
)
def smoke_run(config: RunConfig, facts: RunFacts) -> dict:
    """Overfit a handful of samples for a few dozen steps: the loss must fall before the gate."""
    result = run_smoke(config, facts)
    return {
        "first_loss": round(result.first, 4),
        "last_loss": round(result.last, 4),
        "steps": len(result.losses),
        "seconds": round(result.seconds, 1),
        "samples": result.num_samples,
        "tokens_per_s": result.tokens_per_s,
        "device": result.device,
        "passed": result.passed,
        "modules": result.modules,
    }


# A live check right before the gate: never cached. Not retried: a busy GPU needs a person, not a loop.
@task(name="device-preflight", cache_policy=NO_CACHE)
def preflight(config: RunConfig) -> dict:
    """The devices the run needs are visible and idle, and no earlier eyas launch is still running."""
    return preflight_run(config).to_dict()


# Not cached: the checkpoints are the durable state. Relaunched at most MAX_RELAUNCHES times, 30 s apart (the
# dead ranks release their GPUs and the rendezvous port), and only after progress (relaunch_if_progressed).
@task(
    name="launch-torchrun",
    cache_policy=NO_CACHE,
    retries=MAX_RELAUNCHES,
    retry_delay_seconds=30,
    retry_condition_fn=relaunch_if_progressed,
)
def launch_torchrun(config: RunConfig, facts: RunFacts) -> dict:
    """Run the trainer under torchrun, resuming from the newest complete checkpoint; stream rank-0 metrics
    into progress and a loss curve."""
    total_samples = planned_steps(facts.num_samples, config) * config.train.global_batch_size
    metrics: list[dict] = []
    with StageProgress("train-progress", "training", "samples_consumed", "total") as progress:

        def on_metric(record: dict) -> None:
            metrics.append(record)
            progress({"samples_consumed": record["samples_consumed"], "total": total_samples})

        final = train_run(config, facts, on_metric=on_metric)
    # the whole run, from the metric stream every launch appended to (one record per step after any resume),
    # also when this launch found the training finished and streamed nothing
    history = (
        read_metrics(config.paths.train_dir / METRICS_FILE)
        if (config.paths.train_dir / METRICS_FILE).is_file()
        else metrics
    )
    if history:
        plot_loss(history)
    return final


def launch_starts(metrics: list[dict]) -> list[int]:
    """Steps at which a launch began: the first record, and each where the seconds into the launch went back."""
    starts = [metrics[0]["step"]]
    for before, record in zip(metrics, metrics[1:]):
        if record.get("elapsed_s", 0) < before.get("elapsed_s", 0):
            starts.append(record["step"])
    return starts


def plot_loss(metrics: list[dict]) -> None:
    """The loss per TTT step and the teacher-forced accuracy per draft position over the whole run, with the
    steps where a resumed launch began marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_acc = all(m.get("acc_k") for m in metrics)
    fig, axes = plt.subplots(1, 2 if with_acc else 1, figsize=(11 if with_acc else 7, 3.5), squeeze=False)
    steps = [m["step"] for m in metrics]
    ax = axes[0][0]
    ax.plot(steps, [m["loss"] for m in metrics], label="total (weighted)")
    for k in range(len(metrics[0]["loss_k"])):
        ax.plot(steps, [m["loss_k"][k] for m in metrics], alpha=0.5, lw=0.8, label=f"step {k}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("soft cross-entropy")
    ax.legend(fontsize=7, ncol=2)
    if with_acc:
        acc = axes[0][1]
        for k in range(len(metrics[0]["acc_k"])):
            acc.plot(steps, [m["acc_k"][k] for m in metrics], lw=0.9, label=f"position {k + 1}")
        acc.set_xlabel("optimizer step")
        acc.set_ylabel("teacher-forced accuracy")
        acc.set_ylim(0, 1)
        acc.legend(fontsize=7)
    starts = launch_starts(metrics)
    for step in starts[1:]:
        for row in axes:
            for a in row:
                a.axvline(step, color="grey", ls=":", lw=0.8)
    description = (
        f"training loss per TTT step and accuracy per position, steps {steps[0]}-{steps[-1]} over "
        f"{len(starts)} launch{'es' * (len(starts) != 1)}" + (f" (resumed at {starts[1:]})" if len(starts) > 1 else "")
    )
    png_artifact("loss-curve", fig, description)
    plt.close(fig)
