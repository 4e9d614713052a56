"""Tasks of the training stage: smoke run, device preflight, the torchrun launch with live metrics.

A failed launch is relaunched automatically only if it got further and its first failing rank's
exception could pass (see `relaunch_if_progressed`); the launch itself, what "further" means and
which failures are deterministic is eyas.train.launch. A failed launch's message is the first
failing rank's own exception and the path of train/torchrun.log."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas.config import RunConfig
from eyas.facts import RunFacts
from eyas.markdown import dict_table
from eyas.train.launch import TorchrunFailed, planned_steps, train_run
from eyas.train.metrics import METRICS_FILE, read_metrics
from eyas.train.node_agents import node_agent_run, with_rendezvous_at
from eyas.train.preflight import preflight_run
from eyas.train.smoke import smoke_run as run_smoke
from tasks.caching import cached_by
from tasks.nodes import NodeRuns, this_node_address
from tasks.reporting import StageProgress, StreamSides, markdown_artifact, png_artifact
from tasks.retry import failure_of, log_to_run

MAX_RELAUNCHES = 2


def relaunch_if_progressed(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn` of the launch: relaunch (resuming from the newest checkpoint) only a
    trainer that wrote a newer complete checkpoint before it failed, and whose first failing rank did not
    fail deterministically. Progress means the failure came later than the last one (a node or network
    hiccup, a preempted GPU); a trainer that fails again before its next checkpoint would fail the same
    way on every relaunch (out of memory at a given step, a bug), and so would one whose first failure is
    a verdict on the data or the state (a shard that does not match its manifest, a non-finite loss:
    `TorchrunFailed.deterministic`), however far it got: both stop the run with the reason instead of
    burning GPU-hours."""
    exc = failure_of(state)
    if not isinstance(exc, TorchrunFailed):
        return False
    relaunch = exc.progressed and not exc.deterministic
    if relaunch:
        verdict = "relaunching, it resumes from there"
    elif exc.deterministic:
        verdict = (
            f"not relaunched: rank {exc.failure.rank}'s {exc.failure.type} would stop every launch from this "
            "checkpoint the same way"
        )
    else:
        verdict = "no progress, not relaunched"
    log_to_run(
        f"{task.name}: trainer failed after reaching {exc.newest.name if exc.newest else 'no checkpoint'} "
        f"(started from {exc.started_from.name if exc.started_from else 'step 0'}): {verdict}"
    )
    return relaunch


# Cached by the shards (manifest), vocab and tokenized table and the config sections it trains with, while RUN/smoke
# holds what it wrote. Not retried: compute on local files, and a loss that does not fall is deterministic.
@task(
    name="smoke-run",
    **cached_by(
        ("target", "dataset", "extract", "draft", "train", "smoke"),
        ("tokenized", "vocab", "manifest", "shard_files"),
        outputs=("smoke",),
    ),
)
def smoke_run(config: RunConfig, facts: RunFacts) -> dict:
    """Overfit a handful of samples for a few dozen steps (on a training GPU for a GPU run): the loss must fall."""
    result = run_smoke(config, facts)
    return {
        "first_loss": round(result.first, 4),
        "last_loss": round(result.last, 4),
        "steps": len(result.losses),
        "seconds": round(result.seconds, 1),
        "samples": result.num_samples,
        "tokens_per_s": result.tokens_per_s,
        "device": result.device,
        "precision": result.precision,
        "save_s": result.save_s,
        "peak_bytes": result.peak_bytes,
        "micro_batches": result.micro_batches,
        "passed": result.passed,
        "modules": result.modules,
    }


# A live check right before the gate: never cached. Not retried: a busy GPU needs a person, not a loop.
@task(name="device-preflight", cache_policy=NO_CACHE)
def preflight(config: RunConfig, facts: RunFacts) -> dict:
    """The devices the run needs are visible, idle and large enough for its memory plan, and no earlier eyas
    launch is still running."""
    return preflight_run(config, facts).to_dict()


# Not cached: the checkpoints are the durable state. Relaunched at most MAX_RELAUNCHES times, 30 s apart (the
# dead ranks release their GPUs and the rendezvous port), and only after progress on a failure that may pass
# (relaunch_if_progressed); the task's failure message is the first failing rank's exception.
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
    metrics: list[dict] = []
    last_step = planned_steps(facts.num_samples, config)
    latest_eval: dict = {}
    with StageProgress("train-progress", "training", "step_done", "step_total") as bar:
        progress = StreamSides(config.paths.train_dir, bar) if config.train.start == "streaming" else bar

        def on_metric(record: dict) -> None:
            metrics.append(record)
            latest_eval.update(record.get("eval") or {})
            progress(
                {
                    "step_done": record["step"],
                    "step_total": last_step,
                    "loss": record["loss"],
                    "acc_k": record["acc_k"],
                    "tau_estimate": latest_eval.get("tau_estimate"),
                    "tokens_per_s": record.get("tokens_per_s"),
                    "data_stall_fraction": record.get("data_stall_fraction"),
                }
            )

        config = with_rendezvous_at(config, this_node_address()) if config.train.num_nodes != 1 else config
        nodes = NodeRuns(config, facts)
        try:
            final = train_run(config, facts, on_metric=on_metric, start_nodes=nodes.start)
        finally:
            nodes.report()
    # the whole run, from the metric stream every launch appended to (one record per step after any resume),
    # also when this launch found the training finished and streamed nothing
    history = (
        read_metrics(config.paths.train_dir / METRICS_FILE)
        if (config.paths.train_dir / METRICS_FILE).is_file()
        else metrics
    )
    if history:
        plot_loss(history, final.get("best"))
        report_evaluations(history, final.get("best"))
    return final


# Not cached, not retried: the first node's launch task relaunches the whole job (new flow runs of the further nodes).
@task(name="train-node-agent", cache_policy=NO_CACHE)
def node_agent(config: RunConfig, facts: RunFacts, node_index: int) -> dict:
    """Run this further node's torchrun agent of a training on several nodes (the first node started this run)."""
    return node_agent_run(config, facts, node_index)


def eval_rows(metrics: list[dict], best: dict | None) -> list[dict]:
    """One row per held-out evaluation of the run: step, loss, accuracy per position, estimated tau, best."""
    rows = []
    for m in metrics:
        e = m.get("eval")
        if e:
            rows.append(
                {
                    "step": m["step"],
                    "eval loss": round(e["loss"], 4),
                    "accuracy per position": " / ".join(f"{a:.3f}" for a in e["acc_k"]),
                    "accepted per position (replayed)": " / ".join(f"{a:.3f}" for a in e["accept_rate_k"]),
                    "estimated tau": round(e["tau_estimate"], 3),
                    "best": "BEST" if best and best["step"] == m["step"] else "",
                }
            )
    return rows


def report_evaluations(metrics: list[dict], best: dict | None) -> None:
    """A markdown artifact of the held-out evaluations (none when the run has no held-out split)."""
    rows = eval_rows(metrics, best)
    if not rows:
        return
    head = (
        f"Best checkpoint: `{best['checkpoint']}` (estimated tau {best['tau_estimate']:.3f}); export.checkpoint "
        "chooses best or last."
        if best
        else "No BEST marker."
    )
    chain = next(m["eval"]["chain_steps"] for m in reversed(metrics) if m.get("eval"))
    markdown_artifact(
        "train-evaluation",
        f"# Held-out evaluation while training\n\n{head}\n\n{dict_table(rows)}\n\nEstimated tau: the verification "
        f"rounds of a chain of {chain} replayed over the held-out responses (eyas.train.evaluate).",
        "held-out accuracy and estimated tau per evaluation",
    )


def launch_starts(metrics: list[dict]) -> list[int]:
    """Steps at which a launch began: the first record, and each where the seconds into the launch went back."""
    starts = [metrics[0]["step"]]
    for before, record in zip(metrics, metrics[1:]):
        if record.get("elapsed_s", 0) < before.get("elapsed_s", 0):
            starts.append(record["step"])
    return starts


def plot_loss(metrics: list[dict], best: dict | None = None) -> None:
    """The loss per TTT step and the teacher-forced accuracy per draft position over the whole run, the held-out
    evaluations (accuracy per position dashed, estimated tau on its own panel, the BEST checkpoint starred), with
    the steps where a resumed launch began marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_acc = all(m.get("acc_k") for m in metrics)
    evaluated = [m for m in metrics if m.get("eval")]
    panels = 1 + with_acc + bool(evaluated)
    fig, axes = plt.subplots(1, panels, figsize=(4 + 3.5 * panels, 3.5), squeeze=False)
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
        for k in range(len(evaluated[0]["eval"]["acc_k"]) if evaluated else 0):
            acc.plot(
                [m["step"] for m in evaluated],
                [m["eval"]["acc_k"][k] for m in evaluated],
                ls="--",
                lw=0.9,
                color=f"C{k}",
                label=f"held-out {k + 1}",
            )
        acc.set_xlabel("optimizer step")
        acc.set_ylabel("teacher-forced accuracy")
        acc.set_ylim(0, 1)
        acc.legend(fontsize=7, ncol=2)
    if evaluated:
        tau = axes[0][-1]
        tau.plot([m["step"] for m in evaluated], [m["eval"]["tau_estimate"] for m in evaluated], marker=".", lw=1)
        if best:
            tau.plot([best["step"]], [best["tau_estimate"]], marker="*", ms=12, color="C3", ls="", label="BEST")
            tau.legend(fontsize=7)
        tau.set_xlabel("optimizer step")
        tau.set_ylabel(f"estimated tau (chain of {evaluated[-1]['eval']['chain_steps']}, held out)")
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
