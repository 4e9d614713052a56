"""What `eyas status` says of a training job's nodes and of a stop asked with `eyas stop`, from the records the
trainer leaves in the train directory (eyas.train.nodes):

    info["nodes"] = job_summary(train_dir)     # the newest launch's nodes, each alive or not seen for N s
    lines = node_lines(info)                   # one line per node, for the Progress section
    text = stop_text(info["stop"])             # "stopped by `eyas stop` at step N (requested by U on H at T)"
"""

from __future__ import annotations

from pathlib import Path

from eyas.train.nodes import SILENT_AFTER_S, describe_node, job_nodes, read_stop

SHOWN = ("node_rank", "host", "ranks", "world_size", "pid", "step", "state", "written_at_iso", "seen_s_ago", "alive",
         "why", "restart_count", "run_id")  # fmt: skip


def job_summary(train_dir: Path) -> dict:
    """{"launch_id", "alive": how many nodes are, "nodes": each node's record (SHOWN keys), "ignored": records of
    earlier launches, "stop": the stop request and where it stopped (None without one)}."""
    found = job_nodes(train_dir) if Path(train_dir).is_dir() else {"launch_id": None, "nodes": [], "ignored": 0}
    nodes = [{k: n.get(k) for k in SHOWN} for n in found["nodes"]]
    return {
        "launch_id": found["launch_id"],
        "alive": sum(n["alive"] for n in nodes),
        "nodes": nodes,
        "ignored": found["ignored"],
        "stop": read_stop(train_dir) if Path(train_dir).is_dir() else None,
    }


def node_lines(train: dict) -> list[str]:
    """The Progress section's lines on the job's nodes (none when no node ever wrote a record)."""
    summary = train.get("nodes") or {}
    nodes = summary.get("nodes") or []
    if not nodes:
        return []
    earlier = f"; {summary['ignored']} record(s) of earlier launches not counted" if summary["ignored"] else ""
    head = (
        f"nodes of the running job: {summary['alive']} of {len(nodes)} alive (a node writes every few seconds as "
        f"steps run; silent for over {SILENT_AFTER_S:.0f} s it is not counted){earlier}"
        if summary["alive"]
        else f"nodes of the last launch: none alive{earlier}"
    )
    return [head] + [f"  {describe_node(n)}" for n in nodes]


def stop_text(stop: dict) -> str:
    """Where a stop asked with `eyas stop` ended the training, or that it is pending."""
    asked = f"requested by {stop['requested_by']} on {stop['host']} at {stop['requested_at']}"
    if "stopped_at_step" in stop:
        return f"stopped by `eyas stop` at step {stop['stopped_at_step']:,} ({asked})"
    return f"a stop was {asked}; the ranks stop after their current step"
