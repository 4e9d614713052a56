"""`eyas plan CONFIG [--json]`: the memory plan of a run's training, per device, before anything runs.

    eyas plan deployments/kimi-k25-8gpu.json           # every component, the peak against the device, the fit
    eyas plan deployments/kimi-k25-8gpu.json --json    # MemoryPlan.to_dict()

The target's facts come from its config.json and weight headers (eyas.target.TargetFacts: no weights, no
dataset, no Prefect); the plan is eyas.train.memory_plan's, the one the preflight checks the devices against and
the gate shows. Exit 0 when the plan fits (or the device is not known here: a CUDA run planned away from its
GPUs with train.device_memory_gib 0); exit 2 with the refusal, which names the fixes, when it does not.
"""

from __future__ import annotations

import json
import math
import sys

from eyas.config import RunConfig
from eyas.gate import memory


def read_target(config: RunConfig, config_path: str):
    """The target's facts, or None after saying on stderr why they cannot be read."""
    from eyas.target import TargetError, TargetFacts

    try:
        return TargetFacts.read(config.target.model_path)
    except (OSError, KeyError, TargetError) as err:
        found = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(
            f"eyas plan {config_path}: cannot read the facts of target.model_path={config.target.model_path!r}: "
            f"{found} (the plan reads its config.json and *.safetensors headers, no weights); set target.model_path "
            "in the config, or run where the target is",
            file=sys.stderr,
        )
        return None


def plan_text(config: RunConfig, plan, target) -> list[str]:
    """The plan for a person: what it plans, every component, the budget, the micro-batches, the fit."""
    from eyas.train.memory_plan import HEADROOM, describe_plan

    t, shape, planned = config.train, plan.shape, plan.to_dict()
    micro_batches = math.ceil(shape.share_tokens / max(1, min(plan.micro_batch_tokens, shape.share_tokens)))
    lines = [
        f"memory plan of {config.name}: training on {shape.world} process{'es' * (shape.world != 1)} "
        f"({t.backend}, {shape.parallelism}, {'bf16' if shape.bf16 else 'fp32'}, activation checkpointing "
        f"{'on' if shape.checkpointing else 'off'}), per device",
        f"  target {target.model_path}: hidden {target.hidden_size:,}, vocab {target.vocab_size:,}; draft vocab "
        f"{shape.arch.draft_vocab_size:,}, {shape.num_ttt_steps} unroll steps, samples up to "
        f"{shape.longest_sample:,} tokens",
        f"  {'component':32s} {'size':>13s}  what",
        describe_plan(plan),
    ]
    if plan.device_bytes:
        lines.append(
            f"  {'usable':32s} {plan.usable_bytes / memory.GIB:9.2f} GiB  of the device ({HEADROOM:.0%} kept for "
            f"the allocator and the runtime)"
        )
    lines += [
        f"device budget: {memory.budget_source(config)}",
        f"micro-batches: {memory.micro_batch_text(planned, config)}; at most {micro_batches} per rank per step "
        f"(a rank's share of a global batch: up to {shape.share_tokens:,} tokens)",
        memory.peak_text(planned)
        + ("" if plan.device_bytes else ": the preflight checks the plan against the GPUs it finds"),
    ]
    return lines


def show_plan(config: RunConfig, config_path: str, as_json: bool) -> int:
    """Print the plan; 2 when the target cannot be read or the plan does not fit, else 0."""
    from eyas.train.memory_plan import PlanDoesNotFit, check_run_plan, run_plan

    target = read_target(config, config_path)
    if target is None:
        return 2
    refusal = ""
    try:
        plan = check_run_plan(config, target)
    except PlanDoesNotFit as err:
        plan, refusal = run_plan(config, target), str(err)
    if as_json:
        print(json.dumps(plan.to_dict(), indent=1))
    elif not refusal:
        print("\n".join(plan_text(config, plan, target)))
    if refusal:
        print(f"eyas plan {config_path}: {refusal}", file=sys.stderr)
        return 2
    return 0
