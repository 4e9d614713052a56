"""The summary a reviewer decides on at the approval gate (Markdown: the UI renders it above the form).

    md = gate_summary(config, facts, dataset=..., verified=..., smoke=..., devices=...)

It shows the dataset, the shard verification, every draft module with its parameter count and
whether it trains, the smoke run, the device preflight, the estimate and the exact command.
"""

from __future__ import annotations

from eyas.config import RunConfig
from eyas.facts import RunFacts
from eyas.markdown import dict_table
from eyas.train.launch import JOB_FILE, format_command, gpu_hours_estimate, planned_steps, torchrun_command


def dataset_notes(dataset: dict) -> list[str]:
    """The dataset's row accounting, and a warning when its responses were sampled otherwise than the benchmark
    decodes."""
    notes = []
    acct = dataset.get("accounting") or {}
    if acct:
        reasons = {**acct.get("failed_reasons", {}), **acct.get("skipped_reasons", {})}
        notes.append(
            f"rows: {acct['answered']} answered + {acct['failed']} failed + {acct['skipped']} skipped = "
            f"{acct['input']} input"
            + (f" ({'; '.join(f'{n} x {r}' for r, n in reasons.items())})" if reasons else "")
            + (f"; token ids {acct['token_ids_source']}" if acct.get("token_ids_source") else "")
        )
    gen, bench = dataset.get("generation_temperature"), dataset.get("bench_temperature")
    if gen is not None and bench is not None and gen != bench:
        notes.append(
            f"**sampling mismatch**: the responses were sampled at temperature {gen}, the benchmark decodes at "
            f"{bench}; the draft learns the distribution it was trained on, so tau measured at {bench} may fall "
            "short: regenerate at the serving temperature, or benchmark at the training one"
        )
    return notes


def gate_summary(
    config: RunConfig, facts: RunFacts, *, dataset: dict, verified: dict, smoke: dict, devices: dict
) -> str:
    """The Markdown above the approval form; `dataset`, `verified`, `smoke` and `devices` are the stages'
    summaries (the dataset report, the verification summary, the smoke run, the preflight report)."""
    job_path = config.paths.train_dir / JOB_FILE
    lines = [
        f"# Approve training of `{config.name}`",
        "## Dataset",
        dict_table([{k: v for k, v in dataset.items() if not isinstance(v, dict)}]),
        *dataset_notes(dataset),
        "## Shard verification",
        dict_table([verified]),
        "## Draft modules",
        dict_table(smoke["modules"]),
        "## Smoke run",
        f"loss {smoke['first_loss']} -> {smoke['last_loss']} in {smoke['steps']} steps ({smoke['seconds']} s): "
        f"{'passed' if smoke['passed'] else 'FAILED'}",
        "## Device preflight",
        f"backend {devices['backend']}, {devices['num_processes']} processes: "
        f"{'passed' if devices['ok'] else 'FAILED'}",
        dict_table(devices["devices"]),
        "## Estimate",
        f"{planned_steps(facts.num_samples, config)} optimizer steps on {config.train.num_processes} processes; "
        f"estimated GPU-hours: {gpu_hours_estimate(facts.num_samples, config):.2f}",
        "## Command",
        f"```\n{format_command(torchrun_command(config, job_path))}\n```",
    ]
    return "\n\n".join(lines)
