"""Tasks of the training stage: smoke run, gate summary, the torchrun launch with live metrics."""

from __future__ import annotations

import json
import subprocess

from prefect import task

from eyas.config import RunConfig
from eyas.jobs import format_command, gpu_hours_estimate, planned_steps, torchrun_command, train_job, write_train_job
from eyas.preflight import device_preflight, record_launch
from eyas.smoke import smoke_train
from tasks.reporting import StageProgress, markdown_table, png_artifact

METRIC_PREFIX = "EYAS_METRIC "


@task(name="smoke-run")
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


@task(name="device-preflight")
def preflight(config: RunConfig) -> dict:
    """The devices the run needs are visible and idle, and no earlier eyas launch is still running."""
    report = device_preflight(config.train, config.paths.train_dir)
    if not report.ok:
        raise RuntimeError("device preflight failed:\n" + "\n".join(f"- {p}" for p in report.problems))
    return report.to_dict()


@task(name="gate-summary")
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


@task(name="launch-torchrun")
def launch_torchrun(config: RunConfig, num_samples: int) -> dict:
    """Run the trainer under torchrun, streaming rank-0 metrics into progress and a loss curve."""
    train_dir = config.paths.train_dir
    job_path = write_train_job(train_job(config), train_dir / "job.json")
    cmd = torchrun_command(config, job_path)
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
        raise RuntimeError(f"torchrun exited with {proc.returncode}; last lines of {log_path}:\n{tail}")
    if metrics:
        plot_loss(metrics)
    return json.loads((train_dir / "final.json").read_text())


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
