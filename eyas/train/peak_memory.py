"""The measured peak memory of training steps, next to the memory plan's figure for the same shape.

    with measured_peak(device) as peak:         # CUDA: max_memory_allocated; CPU: the profiler's allocation events
        ...
    peak.bytes                                   # the highest allocated bytes above the start, inside the block

    python -m eyas.train.peak_memory '{"hidden_size": 512, "num_attention_heads": 8, ..., "lengths": [1024, 1024]}'
    python -m eyas.train.peak_memory '{..., "mode": "time", "timed_steps": 3}'      # seconds per step instead

`step_peak(case)` builds a draft of the case's shape with random weights and a synthetic micro-batch of samples of
`lengths` tokens, wraps it as the trainer does (DDP or FSDP2 on a one-process group, or plain), runs two
optimizer steps (the first creates AdamW's state) and returns the measured peak of the whole (draft and its
tensors counted from before the first step) with the plan's (eyas.train.memory_plan) for the same shape. It runs
in a process of its own: the command line above prints one JSON line, which the tests and bench/train_scale.py read.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from eyas.draft import DraftArch, build_draft
from eyas.shards.encoding import ShardEncoding
from eyas.train.memory_plan import PlanShape, plan_memory


@dataclass
class Peak:
    """`bytes`: the highest allocated bytes above the start of the block; `marks`: the allocated bytes above the
    start at each `mark(name)`."""

    device: torch.device
    start: int = 0
    bytes: int = 0
    marks: dict = field(default_factory=dict)

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.marks[name] = torch.cuda.memory_allocated(self.device) - self.start
        else:  # an annotation in the profile; its allocated bytes are read from the events afterwards
            with torch.profiler.record_function(name):
                pass


@contextmanager
def measured_peak(device: torch.device):
    """The highest allocated bytes above the start inside the block: CUDA's allocator statistics, or on CPU the
    running sum of the profiler's allocation and free events (every tensor allocation torch makes)."""
    peak = Peak(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak.start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield peak
        torch.cuda.synchronize(device)
        peak.bytes = torch.cuda.max_memory_allocated(device) - peak.start
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield peak
    events = prof.profiler.kineto_results.events()
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    annotations = {e.name(): e.start_ns() for e in events if e.is_user_annotation()}
    running = 0
    for at, nbytes in allocations:
        running += nbytes
        peak.bytes = max(peak.bytes, running)
        peak.marks.update({name: running for name, start in annotations.items() if at < start})


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors`."""
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def synthetic_batch(arch: DraftArch, lengths: list[int], encoding: ShardEncoding, device) -> dict:
    """A right-padded micro-batch of random samples of `lengths` tokens, as eyas.train.data.collate makes it."""
    b, width = len(lengths), max(lengths)
    valid = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    aux_dtype = (
        torch.float32 if encoding.aux_dtype in ("float32", "float8_e4m3") else getattr(torch, encoding.aux_dtype)
    )
    batch = {
        "input_ids": torch.randint(0, arch.target_vocab_size, (b, width)) * valid,
        "loss_mask": valid.to(torch.uint8),
        "valid": valid,
        "aux_hidden": torch.randn(b, width, arch.num_aux * arch.hidden_size).to(aux_dtype),
    }
    if encoding.teacher == "last_hidden":
        batch["last_hidden"] = torch.randn(b, width, arch.hidden_size).to(getattr(torch, encoding.dtype))
    else:
        k = encoding.teacher_topk
        batch["topk_ids"] = torch.randint(0, arch.target_vocab_size, (b, width, k), dtype=torch.int32)
        batch["topk_logprobs"] = torch.log_softmax(torch.randn(b, width, k), -1).to(getattr(torch, encoding.dtype))
    return {k: v.to(device) for k, v in batch.items()}


@dataclass
class CaseSetup:
    """A case's draft wrapped for training, and what its steps and its plan need."""

    arch: DraftArch
    objective: torch.nn.Module
    encoding: ShardEncoding
    device: torch.device
    baseline_bytes: int  # the draft's parameters and buffers and the head rows, before any step

    def plan_shape(self, case: dict) -> PlanShape:
        lengths = case["lengths"]
        return PlanShape(
            arch=self.arch,
            num_ttt_steps=self.objective.num_steps,
            bf16=self.objective.bf16,
            parallelism=case.get("parallelism", "ddp"),
            world=1,
            checkpointing=self.objective.checkpointing,
            encoding=self.encoding,
            longest_sample=max(lengths),
            share_tokens=len(lengths) * max(lengths),
        )


def build_case(case: dict) -> CaseSetup:
    """The case's draft (its DraftArch fields; random weights), set up as the trainer sets one up: attention
    (fused | blockwise | eager), the frozen embedding and head rows in the training dtype (bf16: autocast)."""
    device, bf16 = torch.device(case.get("device", "cpu")), case.get("bf16", False)
    arch = DraftArch(**{k: v for k, v in case.items() if k in DraftArch.__dataclass_fields__})
    d2t = torch.zeros(arch.draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(arch.target_vocab_size, dtype=torch.bool)
    t2d[: arch.draft_vocab_size] = True
    draft = build_draft(arch, torch.randn(arch.target_vocab_size, arch.hidden_size), d2t, t2d).to(device)
    draft.set_attention(case.get("attention", "fused"))
    dtype = torch.bfloat16 if bf16 else torch.float32
    draft.embed_tokens.to(dtype)
    head_rows = torch.randn(arch.draft_vocab_size, arch.hidden_size, device=device, dtype=dtype)
    from eyas.train.step import TTTObjective

    objective = TTTObjective(
        draft, head_rows, case.get("num_ttt_steps", 7), 0.8, bf16, checkpointing=case.get("checkpointing", False)
    )
    baseline = tensor_bytes([*draft.parameters(), *draft.buffers(), head_rows])
    return CaseSetup(arch, objective, ShardEncoding(**case.get("encoding", {})), device, baseline)


def _training(setup: CaseSetup, case: dict):
    """(model, optimizer, scheduler) as the trainer makes them; a one-process group for DDP and FSDP2."""
    import torch.distributed as dist

    from eyas.train.parallel import parallelize
    from eyas.train.step import make_optimizer, make_scheduler

    parallelism, device = case.get("parallelism", "ddp"), setup.device
    if parallelism != "none" and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    objective = setup.objective
    model = objective if parallelism == "none" else parallelize(objective, parallelism, device, bf16=objective.bf16)
    optimizer = make_optimizer(objective.draft, 1e-4, 0.0)
    return model, optimizer, make_scheduler(optimizer, 1, 2)


def step_peak(case: dict) -> dict:
    """Measured and planned peak of the case (build_case's fields plus lengths and parallelism ddp | fsdp2 |
    none) over its wrapping and two optimizer steps; step_start_bytes: what was allocated before the second."""
    from eyas.train.step import train_step

    setup = build_case(case)
    with measured_peak(setup.device) as peak:
        model, optimizer, scheduler = _training(setup, case)
        for step in range(2):
            batch = synthetic_batch(setup.arch, case["lengths"], setup.encoding, setup.device)
            peak.mark(f"step-{step}")
            train_step(model, optimizer, scheduler, [batch], 1.0)
    shape = setup.plan_shape(case)
    plan = plan_memory(shape, shape.share_tokens, device_bytes=1 << 62)
    return {
        "measured_bytes": setup.baseline_bytes + peak.bytes,
        "step_start_bytes": setup.baseline_bytes + peak.marks.get("step-1", 0),
        "planned_bytes": plan.peak_bytes,
        "plan": plan.to_dict()["rows"],
    }


def step_seconds(case: dict, steps: int = 3) -> dict:
    """The median seconds of `steps` optimizer steps of the case after one warm-up step (batches made first)."""
    import statistics
    import time

    from eyas.train.step import train_step

    setup = build_case(case)
    model, optimizer, scheduler = _training(setup, case)
    batches = [synthetic_batch(setup.arch, case["lengths"], setup.encoding, setup.device) for _ in range(steps + 1)]
    seconds = []
    for batch in batches:
        start = time.perf_counter()
        train_step(model, optimizer, scheduler, [batch], 1.0)
        if setup.device.type == "cuda":
            torch.cuda.synchronize(setup.device)
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds[1:])
    return {"step_s": median, "tokens_per_s": sum(case["lengths"]) / median}


def main(argv: list[str] | None = None) -> int:
    case = json.loads((argv or sys.argv[1:])[0])
    result = step_seconds(case, case.get("timed_steps", 3)) if case.get("mode") == "time" else step_peak(case)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
