"""The memory plan as a person reads it: the gate's Memory section, `eyas status`'s plan line, `eyas plan`.

    plan = plan_of_run(config, target)        # MemoryPlan.to_dict() of the run's training (eyas.train.memory_plan)
    peak_text(plan)                           # "fits: peak 30.9 GiB per device of 139.8 GiB, 25% of its 125.8 GiB usable"
    micro_batch_text(plan, config)            # "4,096 tokens (auto: chosen by the memory plan)"
    largest_text(plan)                        # "activations 20.1 GiB, gathered parameters 4.5 GiB, ..."

Everything reads the plan's dict (MemoryPlan.to_dict()), so that the plan the preflight recorded against its
devices and one computed here from the config read the same.
"""

from __future__ import annotations

from eyas.config import RunConfig

GIB = 1 << 30  # as eyas.train.memory_plan.GIB (not imported: that module imports torch)
SHOWN_COMPONENTS = 3


def gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


def plan_of_run(config: RunConfig, target) -> dict:
    """The plan of the run's training on its target (TargetFacts), as MemoryPlan.to_dict()."""
    from eyas.train.memory_plan import run_plan  # imports torch

    return run_plan(config, target).to_dict()


def budget_source(config: RunConfig) -> str:
    """Where the device budget of a plan computed from the config alone comes from."""
    t = config.train
    if t.device_memory_gib:
        return f"train.device_memory_gib={t.device_memory_gib:g}"
    if t.backend == "gloo":
        return f"this host's available memory shared by train.num_processes={t.num_processes}"
    return "not known here: train.device_memory_gib is 0, so the preflight plans against the GPUs it finds"


def peak_text(plan: dict) -> str:
    """Whether the plan fits, and its peak per device against the device's budget."""
    if not plan["device_bytes"]:
        return f"peak {gib(plan['peak_bytes'])} per device; the device's memory is not known yet"
    return f"{'fits' if plan['fits'] else 'DOES NOT FIT'}: {peak_of_budget(plan)}"


def peak_of_budget(plan: dict) -> str:
    """The peak per device against a known device budget."""
    used = plan["peak_bytes"] / plan["usable_bytes"] if plan["usable_bytes"] else float("inf")
    return (
        f"peak {gib(plan['peak_bytes'])} per device of {gib(plan['device_bytes'])}, {used:.0%} of its "
        f"{gib(plan['usable_bytes'])} usable"
    )


def micro_batch_text(plan: dict, config: RunConfig) -> str:
    """The micro-batch token budget and who chose it."""
    tokens = f"{plan['micro_batch_tokens']:,} tokens"
    if config.train.max_tokens_per_micro_batch:
        return f"{tokens} (train.max_tokens_per_micro_batch)"
    if plan["device_bytes"]:
        return f"{tokens} (auto: chosen by the memory plan)"
    return f"{tokens} (auto: the most it may become; the preflight chooses it against the devices it finds)"


def largest_text(plan: dict, count: int = SHOWN_COMPONENTS) -> str:
    """The `count` largest components, largest first."""
    rows = sorted(plan["rows"], key=lambda row: -row["bytes"])[:count]
    return ", ".join(f"{row['component']} {gib(row['bytes'])}" for row in rows)


def plan_rows(plan: dict) -> list[list[str]]:
    """Every component as [component, GiB, what it is], then the peak: a table's rows."""
    rows = [[row["component"], f"{row['bytes'] / GIB:.2f}", row["what"]] for row in plan["rows"]]
    return rows + [["**peak**", f"**{plan['peak_bytes'] / GIB:.2f}**", "per device"]]


def status_line(plan: dict, config: RunConfig) -> str:
    """`eyas status`'s line: the peak against the budget, the micro-batch tokens, where the budget comes from."""
    return (
        f"{peak_text(plan)}; micro-batches of {micro_batch_text(plan, config)}; device budget: {budget_source(config)}"
    )
