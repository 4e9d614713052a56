"""Tasks of the training stage: smoke run, gate summary, the torchrun launch with live metrics.

The trainer is never re-run blindly: every launch resumes from the newest complete checkpoint in the
train directory (eyas.train) and says which one; a failed launch is relaunched automatically only if
it got further (see `relaunch_if_progressed`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas.checkpoint import TRAINER_STATE_FILE, latest_complete
from eyas.config import RunConfig
from eyas.jobs import format_command, gpu_hours_estimate, planned_steps, torchrun_command, train_job, write_train_job
from eyas.preflight import device_preflight, record_launch
from eyas.smoke import smoke_train
from tasks.caching import cached_by
from tasks.reporting import StageProgress, markdown_table, png_artifact
from tasks.retry import failure_of, log_to_run

METRIC_PREFIX = "EYAS_METRIC "
MAX_RELAUNCHES = 2


class TorchrunFailed(RuntimeError):
    """torchrun exited non-zero; `progressed`: it left a newer complete checkpoint than it started from."""

    def __init__(self, message: str, *, started_from: Path | None, newest: Path | None):
        super().__init__(message)
        self.started_from, self.newest = started_from, newest

    @property
    def progressed(self) -> bool:
        return self.newest is not None and (self.started_from is None or self.newest.name > self.started_from.name)


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
    **cached_by(("target", "dataset", "extract", "draft", "train", "smoke"), ("tokenized", "vocab", "manifest")),
)
def smoke_run(config: RunConfig) -> dict:
    """Overfit a handful of samples for a few dozen steps: the loss must fall before the gate."""
    job = train_job(config, output_dir=config.paths.smoke_dir, max_samples=config.smoke.num_samples)
    result = smoke_train(job, config.smoke)
    if not result.passed:
        raise RuntimeError(
            f"smoke run: loss went {result.first:.3f} -> {result.last:.3f} in {config.smoke.num_steps} steps on "
            f"{config.smoke.num_samples} samples, expected a drop of at least {config.smoke.min_loss_drop:.0%}; "
            f"the features or the objective are wrong: check the shard widths and the vocab mapping"
        )
    return {
        "first_loss": round(result.first, 4),
        "last_loss": round(result.last, 4),
        "steps": len(result.losses),
        "seconds": round(result.seconds, 1),
        "passed": result.passed,
        "modules": result.modules,
    }


# A live check right before the gate: never cached. Not retried: a busy GPU needs a person, not a loop.
@task(name="device-preflight", cache_policy=NO_CACHE)
def preflight(config: RunConfig) -> dict:
    """The devices the run needs are visible and idle, and no earlier eyas launch is still running."""
    report = device_preflight(config.train, config.paths.train_dir)
    if not report.ok:
        raise RuntimeError("device preflight failed:\n" + "\n".join(f"- {p}" for p in report.problems))
    return report.to_dict()


# Formatting of its inputs: cheap, not cached, nothing to retry.
@task(name="gate-summary", cache_policy=NO_CACHE)
def gate_summary(config: RunConfig, dataset: dict, verified: dict, smoke: dict, devices: dict) -> str:
    """The Markdown a reviewer sees above the approval form."""
    job_path = config.paths.train_dir / "job.json"
    num_samples = dataset["dataset"]["num_samples"]
    lines = [
        f"# Approve training of `{config.name}`",
        "## Dataset",
        markdown_table([dataset["dataset"]]),
        "## Shard verification",
        markdown_table([verified]),
        "## Draft modules",
        markdown_table(smoke["modules"]),
        "## Smoke run",
        f"loss {smoke['first_loss']} -> {smoke['last_loss']} in {smoke['steps']} steps ({smoke['seconds']} s): "
        f"{'passed' if smoke['passed'] else 'FAILED'}",
        "## Device preflight",
        f"backend {devices['backend']}, {devices['num_processes']} processes: "
        f"{'passed' if devices['ok'] else 'FAILED'}",
        markdown_table(devices["devices"]),
        "## Estimate",
        f"{planned_steps(num_samples, config)} optimizer steps on {config.train.num_processes} processes; "
        f"estimated GPU-hours: {gpu_hours_estimate(num_samples, config):.2f}",
        "## Command",
        f"```\n{format_command(torchrun_command(config, job_path))}\n```",
    ]
    return "\n\n".join(lines)


# Not cached: the checkpoints are the durable state. Relaunched at most MAX_RELAUNCHES times, 30 s apart (the
# dead ranks release their GPUs and the rendezvous port), and only after progress (relaunch_if_progressed).
@task(
    name="launch-torchrun",
    cache_policy=NO_CACHE,
    retries=MAX_RELAUNCHES,
    retry_delay_seconds=30,
    retry_condition_fn=relaunch_if_progressed,
)
def launch_torchrun(config: RunConfig, num_samples: int) -> dict:
    """Run the trainer under torchrun, resuming from the newest complete checkpoint; stream rank-0 metrics
    into progress and a loss curve."""
    train_dir = config.paths.train_dir
    job_path = write_train_job(train_job(config), train_dir / "job.json")
    cmd = torchrun_command(config, job_path)
    started_from = latest_complete(train_dir)
    print(describe_start(started_from, config))
    print(f"launching: {format_command(cmd)}")
    total_samples = planned_steps(num_samples, config) * config.train.global_batch_size
    metrics, log_path = [], train_dir / "torchrun.log"
    with (
        StageProgress("train-progress", "training", "samples_consumed", "total") as progress,
        open(log_path, "a") as log,
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        ) as proc,
    ):
        record_launch(train_dir, proc.pid, cmd)
        for line in proc.stdout:
            log.write(line)
            if line.startswith(METRIC_PREFIX):
                m = json.loads(line[len(METRIC_PREFIX) :])
                metrics.append(m)
                progress({"samples_consumed": m["samples_consumed"], "total": total_samples})
    if proc.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        newest = latest_complete(train_dir)
        raise TorchrunFailed(
            f"torchrun exited with {proc.returncode} (started from {started_from or 'step 0'}, newest complete "
            f"checkpoint now {newest or 'none'}); last lines of {log_path}:\n{tail}",
            started_from=started_from,
            newest=newest,
        )
    if metrics:
        plot_loss(metrics)
    return json.loads((train_dir / "final.json").read_text())


def describe_start(checkpoint: Path | None, config: RunConfig) -> str:
    copy = config.train.checkpoint_copy_url
    restore = f" (a newer one in train.checkpoint_copy_url={copy} is restored first)" if copy else ""
    if checkpoint is None:
        return f"no complete checkpoint in {config.paths.train_dir}: training starts at step 0{restore}"
    state = json.loads((checkpoint / TRAINER_STATE_FILE).read_text())
    return f"resuming from {checkpoint} (step {state['step']}, {state['samples_consumed']} samples consumed){restore}"


def plot_loss(metrics: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    steps = [m["step"] for m in metrics]
    ax.plot(steps, [m["loss"] for m in metrics], label="total (weighted)")
    for k in range(len(metrics[0]["loss_k"])):
        ax.plot(steps, [m["loss_k"][k] for m in metrics], alpha=0.5, lw=0.8, label=f"step {k}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("soft cross-entropy")
    ax.legend(fontsize=7, ncol=2)
    png_artifact("loss-curve", fig, "training loss per TTT step")
    plt.close(fig)
