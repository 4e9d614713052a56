"""The combined budget a reviewer approves once in a streamed run (the gate comes before extraction): the
regeneration, the extraction and the training device-hours, the bytes the shards take in storage, the retention.

    budget = streaming_budget(config, facts, dataset=report, extracted=smoke_extraction, smoke=smoke_result)
    lines = budget_lines(budget)        # one sentence per part, for the gate summary's three layouts

- regeneration: what the dataset stage reports (eyas.dataset.build.DatasetReport: its seconds, whether it was
  reused); device-hours where eyas knows the devices (an SGLang server it launched: generation.sglang_tp_size),
  none for servers it was given (their devices are not its to count) or for responses taken as given.
- extraction: the speed of the shards extracted for the smoke run (`extracted`, an ExtractSummary dict:
  tokens_written / seconds over its num_workers workers) scaled to the plan's tokens on extract.num_workers
  workers, each using one device (a GPU, or one CPU worker) or, with SGLang, extract.sglang.tp_size GPUs. A smoke
  extraction that wrote nothing measured no speed: no figure then.
- training: eyas.train.launch.training_estimate (the smoke run's speed scaled to the planned steps).
- storage: the plan's tokens times the encoding's bytes per token (eyas.extract.plan.describe_extraction); with
  extract.retention = N shards, at most the N largest planned shards at once.
"""

from __future__ import annotations

from eyas.config import RunConfig
from eyas.extract.plan import describe_extraction
from eyas.facts import RunFacts
from eyas.shards.encoding import extract_encoding
from eyas.train.launch import training_estimate


def _hours(seconds: float | None, devices: int) -> float | None:
    return seconds * devices / 3600 if seconds is not None else None


def regeneration_budget(config: RunConfig, dataset: dict) -> dict:
    """How the responses were made, in how long, on how many devices eyas knows of (None: unknown or none)."""
    gen = config.dataset.generation
    responses = dataset.get("responses", config.dataset.responses)
    seconds = dataset.get("seconds") if responses == "regenerate" else None
    devices = gen.sglang_tp_size if gen.generator == "sglang" and not gen.server_urls else None
    return {
        "responses": responses,
        "generator": dataset.get("generator", gen.generator),
        "num_samples": dataset.get("num_samples"),
        "seconds": seconds,
        "reused": bool(dataset.get("reused")),
        "devices": devices,
        "device_hours": _hours(seconds, devices) if devices else None,
    }


def extraction_budget(config: RunConfig, tokens_total: int, extracted: dict) -> dict:
    """The whole extraction's wall time and device-hours, scaled from the smoke run's extraction."""
    cfg = config.extract
    per_worker = cfg.sglang.tp_size if cfg.backend == "sglang" else 1
    on_gpu = cfg.backend == "sglang" or cfg.device == "cuda"
    written, seconds = extracted.get("tokens_written", 0), extracted.get("seconds", 0.0)
    speed = written / seconds / max(1, extracted.get("num_workers", 1)) if written and seconds > 0 else None
    wall_s = tokens_total / (speed * cfg.num_workers) if speed else None
    return {
        "tokens": tokens_total,
        "tokens_per_s": speed,  # per worker, as the smoke extraction measured it
        "workers": cfg.num_workers,
        "devices": cfg.num_workers * per_worker,
        "unit": "GPU-hours" if on_gpu else "CPU worker-hours",
        "wall_s": wall_s,
        "device_hours": _hours(wall_s, cfg.num_workers * per_worker),
    }


def storage_budget(config: RunConfig, facts: RunFacts) -> dict:
    """The shards' bytes at the chosen encoding, all of them and at most at once (the retention window)."""
    enc = extract_encoding(config.extract)
    bytes_per_token = enc.bytes_per_token(hidden_size=facts.hidden_size, num_aux=facts.num_aux)
    _, plan = describe_extraction(config.extract, facts, target_dtype=config.target.dtype)
    sizes = sorted((p.num_tokens * bytes_per_token for p in plan), reverse=True)
    retention = config.extract.retention
    return {
        "encoding": f"aux {enc.aux_dtype}, teacher {enc.teacher}"
        + (f" top-{enc.teacher_topk}" if enc.teacher == "topk" else f" {enc.dtype}"),
        "bytes_per_token": bytes_per_token,
        "num_shards": len(plan),
        "tokens": sum(p.num_tokens for p in plan),
        "bytes_total": sum(sizes),
        "retention": retention,
        "bytes_bound": sum(sizes) if retention == "keep" else sum(sizes[:retention]),
        "where": config.extract.storage_url or "the run's shards dir",
    }


def streaming_budget(config: RunConfig, facts: RunFacts, *, dataset: dict, extracted: dict, smoke: dict) -> dict:
    """The four parts of a streamed run's cost (see the module's docstring) and the device-hours they add up to
    where every part has a figure in the same unit."""
    storage = storage_budget(config, facts)
    budget = {
        "regeneration": regeneration_budget(config, dataset),
        "extraction": extraction_budget(config, storage["tokens"], extracted),
        "training": training_estimate(config, facts, smoke),
        "storage": storage,
    }
    ext, train = budget["extraction"], budget["training"]
    train_unit = "GPU-hours" if train["trains_on"] == "cuda" else "CPU worker-hours"
    parts = [ext["device_hours"], train["device_hours"], budget["regeneration"]["device_hours"] or 0.0]
    same_unit = ext["unit"] == train_unit == "GPU-hours"
    budget["total_device_hours"] = sum(parts) if same_unit and None not in parts else None
    return budget


def duration_text(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def bytes_text(num_bytes: int) -> str:
    """Bytes in the largest binary unit (KiB to TiB) they fill at least once."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if num_bytes >= size:
            return f"{num_bytes / size:,.1f} {unit}"
    return f"{num_bytes / 1024:,.1f} KiB"


def regeneration_line(r: dict) -> str:
    if r["responses"] != "regenerate":
        return "regeneration: none (the conversations' own responses are trained on)"
    took = f"{duration_text(r['seconds'])}" if r["seconds"] is not None else "an unreported time"
    reused = " (reused: spent by an earlier run)" if r["reused"] else ""
    samples = f"{r['num_samples']:,} responses" if r["num_samples"] is not None else "the responses"
    cost = (
        f", {r['device_hours']:.2f} GPU-hours on {r['devices']} GPU{'s' * (r['devices'] != 1)}"
        if r["device_hours"] is not None
        else ", on servers eyas did not launch (their devices are not counted)"
        if r["generator"] != "hf"
        else ""
    )
    return f"regeneration: {samples} by {r['generator']} in {took}{cost}{reused}"


def extraction_line(e: dict) -> str:
    if e["wall_s"] is None:
        return (
            f"extraction: {e['tokens']:,} tokens on {e['workers']} workers; no time figure: the smoke run's "
            "extraction wrote no tokens it timed"
        )
    return (
        f"extraction: about {duration_text(e['wall_s'])} wall, {e['device_hours']:.2f} {e['unit']} ({e['tokens']:,} "
        f"tokens on {e['workers']} worker{'s' * (e['workers'] != 1)} at the smoke extraction's "
        f"{e['tokens_per_s']:,.0f} tokens/s each)"
    )


def training_line(t: dict) -> str:
    if t["device_hours"] is None:
        return f"training: {t['steps']:,} steps, {t['tokens']:,} tokens; no device-hour figure (see Estimate)"
    unit = "GPU-hours" if t["trains_on"] == "cuda" else "CPU process-hours"
    return f"training: about {duration_text(t['wall_s'])} wall, {t['device_hours']:.2f} {unit}"


def storage_line(s: dict) -> str:
    total = f"{s['num_shards']:,} shards, {bytes_text(s['bytes_total'])} in {s['where']} ({s['encoding']}, "
    total += f"{s['bytes_per_token']:,} bytes/token)"
    if s["retention"] == "keep":
        return f"storage: {total}; retention keep: every shard stays (exact resume, later epochs)"
    return (
        f"storage: {total}; retention {s['retention']} shards: at most {bytes_text(s['bytes_bound'])} at once, each "
        "shard deleted once the trainer's newest checkpoint is past its last use (single epoch)"
    )


def budget_lines(budget: dict) -> list[str]:
    """One sentence per part of the budget, and the total where there is one."""
    lines = [
        regeneration_line(budget["regeneration"]),
        extraction_line(budget["extraction"]),
        training_line(budget["training"]),
        storage_line(budget["storage"]),
    ]
    if budget["total_device_hours"] is not None:
        lines.append(f"total: {budget['total_device_hours']:.2f} GPU-hours")
    return lines
