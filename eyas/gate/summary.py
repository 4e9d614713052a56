"""What a reviewer decides on at the approval gate, in three layouts of the same facts.

    summary = gate_summary(config, facts, dataset=..., verified=..., smoke=..., devices=...)
    summary.terminal   # plain text for an 80-column terminal, printed before `Approve training now? [y/N]`
    summary.dialog     # Markdown for the Prefect UI's Resume dialog (narrow: no wide table, the command wrapped)
    summary.full       # the complete Markdown (every table), a full-width artifact linked from the dialog

The facts come first and once (`review`): the draft's modules with parameter counts, shapes and whether
each trains (and the totals), the data (samples, tokens, shards verified), the smoke run (where and in which
precision it ran, its speed, its checkpoint save), the device preflight, the memory plan (the preflight's, else
one computed from the config: eyas.gate.memory), the estimate (scaled from the smoke run's measured speed,
eyas.train.launch.training_estimate), the risks and the exact command.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from eyas.config import RunConfig
from eyas.facts import RunFacts
from eyas.gate import memory
from eyas.gate.budget import budget_lines, duration_text, streaming_budget
from eyas.markdown import dict_table, table
from eyas.train.launch import JOB_FILE, format_command, torchrun_command, training_estimate, wrap_command

SUMMARY_FILE = "gate-summary.txt"  # in the workdir: the terminal's copy (eyas_cli.approval prints it)
TERMINAL_WIDTH = 80
DIALOG_COMMAND_WIDTH = 44  # characters of a command line in the Resume dialog's code block (checked in Chromium)


@dataclass(frozen=True)
class GateSummary:
    terminal: str
    dialog: str
    full: str

    @classmethod
    def plain(cls, text: str) -> "GateSummary":
        """One text in all three places (probes and tests)."""
        return cls(terminal=text, dialog=text, full=text)


def token_sources(sources) -> str:
    """Where the samples' token ids came from: `638 local` (a count per source), or the source as given."""
    if isinstance(sources, dict):
        return ", ".join(f"{n:,} {source}" for source, n in sources.items())
    return str(sources)


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
            + (f"; token ids: {token_sources(acct['token_ids_source'])}" if acct.get("token_ids_source") else "")
        )
        notes += [f"{url}: {'; '.join(dropped)}" for url, dropped in acct.get("fallbacks", {}).items()]
        notes += [f"{url} {why}" for url, why in acct.get("servers_taken_out", {}).items()]
    gen, bench = dataset.get("generation_temperature"), dataset.get("bench_temperature")
    if gen is not None and bench is not None and gen != bench:
        notes.append(
            f"**sampling mismatch**: the responses were sampled at temperature {gen}, the benchmark decodes at "
            f"{bench}; the draft learns the distribution it was trained on, so tau measured at {bench} may fall "
            "short: regenerate at the serving temperature, or benchmark at the training one"
        )
    return notes


def shape_items(shapes: dict) -> list[str]:
    """A module's parameter shapes as `weight [512, 128]`, one item per parameter (just `[512, 128]` when the
    module's only parameter is its weight)."""
    if list(shapes) == ["weight"]:
        return [str(shapes["weight"])]
    return [f"{name} {shape}" for name, shape in shapes.items()]


def _lay_out(items: list[str], start: str, width: int) -> list[str]:
    """Items after `start`, separated by ", ", never broken inside one; continuation lines aligned under the first."""
    if not items:
        return [start.rstrip()]
    if len(start) + max(len(item) + 1 for item in items) > width:  # a column too narrow: the items below the row
        return [start.rstrip(), *(" " * 6 + item + ("," if i < len(items) - 1 else "") for i, item in enumerate(items))]
    lines, line = [], start
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if line.strip() and line != start and len(line) + 1 + len(piece) > width:
            lines.append(line)
            line = " " * len(start) + piece
        else:
            line = f"{line} {piece}" if line != start else start + piece
    return [*lines, line]


def smoke_conditions(smoke: dict) -> str:
    """Where and how the smoke run ran: device, precision, speed, checkpoint save, measured peak (the keys a
    smoke result of an older eyas lacks are left out)."""
    where = f"on {smoke.get('device', 'cpu')}" + (f" in {smoke['precision']}" if smoke.get("precision") else "")
    parts = [where + (f" at {smoke['tokens_per_s']:,.0f} tokens/s" if smoke.get("tokens_per_s") else "")]
    if smoke.get("save_s") is not None:
        parts.append(f"checkpoint save {smoke['save_s']:,.1f} s")
    if smoke.get("peak_bytes"):
        parts.append(f"measured peak {memory.gib(smoke['peak_bytes'])}")
    return "; ".join(parts)


def memory_facts(config: RunConfig, plan: dict) -> dict:
    """The Memory section: the peak against the budget, the micro-batch tokens, the largest components."""
    return {
        "peak": memory.peak_text(plan),
        "micro_batch": f"micro-batches of {memory.micro_batch_text(plan, config)}",
        "largest": f"largest: {memory.largest_text(plan)}",
        "rows": memory.plan_rows(plan),
    }


def gate_risks(config: RunConfig, smoke: dict, plan: dict) -> list[str]:
    """What may break the training run though every check passed."""
    risks, timeout_s = [], config.train.collective_timeout_s
    save_s = smoke.get("save_s")
    if save_s is not None and save_s > timeout_s / 2:
        risks.append(
            f"a checkpoint save took {save_s:,.1f} s in the smoke run, more than half of "
            f"train.collective_timeout_s={timeout_s}: raise it, or write checkpoints to faster storage"
        )
    if plan["device_bytes"] and not plan["fits"]:
        risks.append(
            f"the memory plan does not fit the device: {memory.peak_of_budget(plan)}; `eyas plan CONFIG` names the fixes"
        )
    return risks


def estimate_text(config: RunConfig, est: dict) -> str:
    """The cost of the training run, from eyas.train.launch.training_estimate."""
    hours = "GPU-hours" if est["trains_on"] == "cuda" else "CPU process-hours"
    if est["wall_s"] is not None:
        return (
            f"about {duration_text(est['wall_s'])} wall, {est['device_hours']:.2f} {hours} "
            f"({est['steps']:,} steps, {est['tokens']:,} tokens on {est['processes']} "
            f"process{'es' * (est['processes'] != 1)} at the smoke run's {est['tokens_per_s']:,.0f} "
            "tokens/s each)"
        )
    if est["tokens_per_s"]:
        return (
            f"{est['steps']:,} steps, {est['tokens']:,} tokens; no wall-time figure: the smoke run measured "
            f"{est['tokens_per_s']:,.0f} tokens/s on {est['measured_on']}, and training runs on {est['trains_on']}"
        )
    return f"{est['steps']:,} steps, {est['tokens']:,} tokens; the smoke run measured no speed"


def nodes_text(config: RunConfig) -> str:
    """The nodes of a training on several nodes: how many, the world size, the rendezvous, who starts the further
    nodes; empty on one node."""
    t = config.train
    low, high = t.node_range
    if high == 1:
        return ""
    count = f"{low}" if low == high else f"{low} to {high}"
    world = f"{low * t.num_processes}" if low == high else f"{low * t.num_processes} to {high * t.num_processes}"
    starts = (
        f"the training flow starts nodes 2-{high} as flow runs of {t.node_deployment}"
        if t.node_deployment
        else "start it on every further node by hand, on machines sharing the run's directory at the same path"
    )
    at = t.rdzv_endpoint or "the first node's address, filled in at launch"
    return (
        f"{count} nodes x {t.num_processes} processes (world size {world}); the command below on every node: "
        f"{starts}; c10d rendezvous at {at}, join timeout {t.rdzv_join_timeout_s} s"
    )


def review(
    config: RunConfig,
    facts: RunFacts,
    *,
    dataset: dict,
    verified: dict,
    smoke: dict,
    devices: dict,
    extracted: dict | None = None,
) -> dict:
    """The facts of the decision, from the stages' summaries (the dataset report, the verification summary, the
    smoke run, the preflight report; its memory plan under "plan", else computed here); with `extracted` (the
    ExtractSummary of the shards extracted for a streamed run's smoke run) the combined budget too."""
    plan = devices.get("plan") or memory.plan_of_run(config, facts.target)
    modules = [
        {**m, "shapes": ", ".join(shape_items(m["shapes"])), "shape_items": shape_items(m["shapes"])}
        for m in smoke["modules"]
    ]
    trainable = sum(m["num_params"] for m in modules if m["trainable"])
    frozen = sum(m["num_params"] for m in modules if not m["trainable"])
    est = training_estimate(config, facts, smoke)
    shards = verified.get("shards")
    data = f"{facts.num_samples:,} samples, {dataset.get('num_tokens', est['tokens']):,} tokens"
    if "num_loss_tokens" in dataset:
        data += f" ({dataset['num_loss_tokens']:,} trained on)"
    if shards is not None:
        data += f"; {verified['ok']} of {shards} shards verified ({verified['mode']})"
    else:
        data += f"; shards: verification {verified.get('mode', 'not run')}"
    return {
        "name": config.name,
        "modules": modules,
        "trainable_params": trainable,
        "frozen_params": frozen,
        "data": data,
        "smoke": (
            f"loss {smoke['first_loss']:.3f} -> {smoke['last_loss']:.3f} in {smoke['steps']} steps on "
            f"{smoke.get('samples', '?')} samples: {'passed' if smoke['passed'] else 'FAILED'}"
        ),
        "smoke_conditions": smoke_conditions(smoke),
        "devices": (
            f"{devices['backend']}, {devices['num_processes']} "
            f"process{'es' * (devices['num_processes'] != 1)}: {'passed' if devices['ok'] else 'FAILED'}"
        ),
        "nodes": nodes_text(config),
        "memory": memory_facts(config, plan),
        "estimate": estimate_text(config, est),
        "risks": gate_risks(config, smoke, plan),
        "command": torchrun_command(config, config.paths.train_dir / JOB_FILE),
        "notes": dataset_notes(dataset),
        "budget": (
            budget_lines(streaming_budget(config, facts, dataset=dataset, extracted=extracted, smoke=smoke))
            if extracted is not None
            else []
        ),
    }


def _wrapped(label: str, text: str) -> list[str]:
    return textwrap.wrap(
        text, TERMINAL_WIDTH, initial_indent=f"{label:<10}", subsequent_indent=" " * 10, break_on_hyphens=False
    )


def terminal_text(r: dict) -> str:
    """The decision for an 80-column terminal. The command block is flush left, an argument longer than a line
    split inside itself with a backslash-newline: pasted whole, the block runs as the command."""
    rows = [
        (m["module"], f"{m['num_params']:,}", "yes" if m["trainable"] else "FROZEN", m["shape_items"])
        for m in r["modules"]
    ]
    width = max(len("module"), *(len(row[0]) for row in rows))
    count = max(len("params"), *(len(row[1]) for row in rows))
    lines = [f"Approve training of {r['name']}?", "", "Draft modules"]
    head = f"  {'module':<{width}}  {'params':>{count}}  {'trains':<6}  "
    lines.append(head + "shapes")
    for name, n, trains, shapes in rows:
        start = f"  {name:<{width}}  {n:>{count}}  {trains:<6}  "
        lines += _lay_out(shapes, start, TERMINAL_WIDTH)
    lines.append(f"  total: {r['trainable_params']:,} trainable, {r['frozen_params']:,} frozen")
    lines.append("")
    lines += _wrapped("Data", r["data"])
    for note in r["notes"]:
        lines += _wrapped("", note.replace("**", ""))
    lines += _wrapped("Smoke", r["smoke"]) + _wrapped("", r["smoke_conditions"])
    lines += _wrapped("Devices", r["devices"])
    lines += _wrapped("Nodes", r["nodes"]) if r["nodes"] else []
    mem = r["memory"]
    lines += _wrapped("Memory", mem["peak"]) + _wrapped("", mem["micro_batch"]) + _wrapped("", mem["largest"])
    lines += _wrapped("Estimate", r["estimate"])
    for i, line in enumerate(r["budget"]):
        lines += _wrapped("" if i else "Budget", line)
    for i, risk in enumerate(r["risks"]):
        lines += _wrapped("" if i else "Risks", risk)
    lines += ["Command", *wrap_command(r["command"], TERMINAL_WIDTH, split_words=True)]
    return "\n".join(lines)


def dialog_markdown(r: dict) -> str:
    """The decision for the Resume dialog: the few facts first, a three-column module table, the command
    wrapped to the dialog's width."""
    rows = [
        [f"`{m['module']}`", f"{m['num_params']:,}", "yes" if m["trainable"] else "**frozen**"] for m in r["modules"]
    ]
    command = "\n".join(wrap_command(r["command"], DIALOG_COMMAND_WIDTH, split_words=True))
    mem = r["memory"]
    lines = [
        f"### Approve training of `{r['name']}`",
        *(f"- **risk** {risk}" for risk in r["risks"]),
        f"- **trains** {r['trainable_params']:,} parameters, **frozen** {r['frozen_params']:,}",
        f"- **cost** {r['estimate']}",
        *(f"- **budget** {line}" for line in r["budget"]),
        f"- **data** {r['data']}",
        f"- **smoke run** {r['smoke']}; {r['smoke_conditions']}",
        f"- **devices** {r['devices']}",
        *([f"- **nodes** {r['nodes']}"] if r["nodes"] else []),
        f"- **memory** {mem['peak']}; {mem['micro_batch']}; {mem['largest']}",
        *(f"- {note}" for note in r["notes"]),
        table(["module", "params", "trains"], rows),
        f"```\n{command}\n```",
    ]
    return "\n\n".join(lines)


def full_markdown(r: dict, *, dataset: dict, verified: dict, devices: dict) -> str:
    """Every table: the dataset report, the verification, the modules with shapes, the devices."""
    lines = [
        f"# Approval gate of `{r['name']}`: the complete summary",
        "## Dataset",
        dict_table([{k: v for k, v in dataset.items() if not isinstance(v, dict)}]),
        *r["notes"],
        "## Shard verification",
        dict_table([verified]),
        "## Draft modules",
        dict_table([{k: v for k, v in m.items() if k != "shape_items"} for m in r["modules"]]),
        f"total: {r['trainable_params']:,} trainable, {r['frozen_params']:,} frozen",
        "## Smoke run",
        f"{r['smoke']}; {r['smoke_conditions']}",
        "## Device preflight",
        r["devices"],
        dict_table(devices["devices"]),
        *(["## Nodes", r["nodes"]] if r["nodes"] else []),
        "## Memory plan",
        f"{r['memory']['peak']}; {r['memory']['micro_batch']}",
        table(["component", "GiB", "what"], r["memory"]["rows"]),
        "## Estimate",
        r["estimate"],
        *(["## Combined budget", "\n".join(f"- {line}" for line in r["budget"])] if r["budget"] else []),
        *(["## Risks", *(f"- {risk}" for risk in r["risks"])] if r["risks"] else []),
        "## Command",
        f"```\n{format_command(r['command'])}\n```",
    ]
    return "\n\n".join(lines)


def gate_summary(
    config: RunConfig,
    facts: RunFacts,
    *,
    dataset: dict,
    verified: dict,
    smoke: dict,
    devices: dict,
    extracted: dict | None = None,
) -> GateSummary:
    """The three layouts of the decision; `dataset`, `verified`, `smoke` and `devices` are the stages'
    summaries, `extracted` the smoke run's extraction in a streamed run (then the combined budget shows)."""
    r = review(config, facts, dataset=dataset, verified=verified, smoke=smoke, devices=devices, extracted=extracted)
    return GateSummary(
        terminal=terminal_text(r),
        dialog=dialog_markdown(r),
        full=full_markdown(r, dataset=dataset, verified=verified, devices=devices),
    )
