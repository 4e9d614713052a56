"""The Progress section of `eyas status`: the figures the probes found (eyas.status.probes), and the training's
memory plan computed from the config and its target's facts.

    progress["plan"] = training_plan(config)          # MemoryPlan.to_dict(), or {"error": why not}
    lines = progress_lines(progress, config)          # shards, streaming, checkpoint, last metrics, plan, acceptance
"""

from __future__ import annotations

from eyas.config import RunConfig
from eyas.gate import memory
from eyas.status.nodes import node_lines
from eyas.status.probes import READ_ERRORS
from eyas.status.stream import stream_lines


def training_plan(config: RunConfig) -> dict:
    """The plan of the run's training per device (eyas.train.memory_plan), or {"error": ...} when the target's
    facts cannot be read here (a target that lives on the training machine only)."""
    from eyas.target import TargetFacts

    try:
        return memory.plan_of_run(config, TargetFacts.read(config.target.model_path))
    except READ_ERRORS as err:
        return {"error": f"target.model_path={config.target.model_path!r}: {err}"}


def plan_line(plan: dict, config: RunConfig | None) -> str:
    if "error" in plan or config is None:
        return (
            f"memory plan: not computed here ({plan.get('error', 'no config')}); `eyas plan CONFIG` where the "
            "target's config.json and weight headers are"
        )
    return f"memory plan: {memory.status_line(plan, config)}"


def metrics_line(m: dict) -> str:
    """The newest metric record: step, loss, rate, and what the step computed (padding, micro-batches, peak)."""
    line = (
        f"last metrics: step {m.get('step')}, epoch {m.get('epoch')}, loss {m.get('loss', float('nan')):.4f}, "
        f"lr {m.get('lr', 0):.2e}, {m.get('elapsed_s', 0):,.0f} s into the launch"
    )
    if "padding_waste" in m:
        line += f"; padding waste {m['padding_waste']:.1%} of the computed tokens"
    if "micro_batches" in m:
        line += f", {m['micro_batches']} micro-batch{'es' * (m['micro_batches'] != 1)} per step (rank 0)"
    if m.get("peak_memory_bytes"):
        line += f", measured peak {memory.gib(m['peak_memory_bytes'])} per device"
    return line


def acceptance_line(progress: dict) -> str:
    acc = progress.get("acceptance")
    if acc:
        per_pos = ", ".join(f"{r:.2f}" for r in acc.get("accept_rate_per_position") or [])
        return (
            f"tau {acc['tau_mean']:.2f} ({acc['engine']} engine)"
            + (f", n-gram {acc['tau_ngram']:.2f}" if "tau_ngram" in acc else "")
            + (f", random draft {acc['tau_random']:.2f}" if "tau_random" in acc else "")
            + (f"; acceptance per position {per_pos}" if per_pos else "")
        )
    evaluated = progress.get("train", {}).get("eval")
    if evaluated:
        return (
            f"no benchmark yet; estimated tau {evaluated['tau_estimate']:.2f} for a chain of "
            f"{evaluated['chain_steps']} from the held-out split at step {evaluated['step']:,}"
        )
    metrics = progress.get("train", {}).get("last_metrics")
    if metrics and metrics.get("acc_k"):
        acc_k = ", ".join(f"{a:.2f}" for a in metrics["acc_k"])
        return (
            f"no benchmark yet; teacher-forced accuracy per TTT step at step {metrics['step']:,}: {acc_k} (not a tau)"
        )
    return "no benchmark yet"


def progress_lines(p: dict, config: RunConfig | None) -> list[str]:
    lines = []
    if "shards" in p:
        s, v = p["shards"], p.get("verified", {})
        lines.append(
            f"shards: {s['done']:,} of {s['planned']:,} extracted ({s['bytes_done'] / (1 << 30):.2f} GiB), "
            f"{v.get('ok', 0):,} verified; {s['quarantined']} quarantined"
            + (f" (latest: {s['last_quarantine_reason']})" if s["last_quarantine_reason"] else "")
            + (f"; {s['interrupted_writes']} interrupted writes, removed on resume" if s["interrupted_writes"] else "")
        )
    if "plan" in p:
        lines.append(plan_line(p["plan"], config))
    if "stream" in p:
        lines += stream_lines(p["stream"])
    t = p.get("train", {})
    if t.get("checkpoint"):
        of = f" of {t['planned_steps']:,}" if t.get("planned_steps") else ""
        lines.append(
            f"checkpoint: step {t['step']:,}{of}, {t['samples_consumed']:,} samples consumed: `{t['checkpoint']}`"
        )
    if t.get("last_metrics"):
        lines.append(metrics_line(t["last_metrics"]))
    lines += node_lines(t)
    if t.get("eval"):
        e, best = t["eval"], t.get("best")
        lines.append(
            f"held-out evaluation at step {e['step']:,}: estimated tau {e['tau_estimate']:.2f}, accuracy per "
            f"position {', '.join(f'{a:.2f}' for a in e['acc_k'])}, loss {e['loss']:.4f}"
            + (f"; best checkpoint {best['checkpoint']} (estimated tau {best['tau_estimate']:.2f})" if best else "")
        )
    lines.append(f"acceptance: {acceptance_line(p)}")
    return lines
