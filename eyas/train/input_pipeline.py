"""The trainer's input: a rank's next steps read, collated and (on CUDA) pinned in a background thread while the
current step trains, then copied to the device without blocking and their float8 aux decoded there.

    steps = RankSteps(samples, train_ids, train, windows, rank=0, world=8, max_len=4096, micro_batch_tokens=8192,
                      pin_memory=device.type == "cuda")
    pipeline = InputPipeline(steps, range(consumed, last_step * gbs, gbs), depth=1,
                             device=device, encoding=meta.encoding, num_aux=3)
    try:
        step = pipeline.next(consumed)      # StepInput: epoch, ids, micro-batches on the device, wait_s
    finally:
        pipeline.stop(); samples.close(); pipeline.join()

The training order is a function of the data position (eyas.train.data.batch_at), so the thread walks the same
positions the loop will train, from the resumed one. `build(position)` (a RankSteps) reads one step's share of
this rank, float8 aux as stored, straight into its micro-batches (pinned when the device is CUDA) with large
sequential reads (ShardSamples.read_sample_into; the batches eyas.train.data.collate makes): a HostStep. The thread keeps at most `depth` finished steps in a queue
and builds one more, so host memory holds at most depth + 1 steps of a rank's collated share, plus the step the
loop copies. `depth` 0 builds each step in the loop itself: the same functions, the same batches.

An exception of the thread (a ShardDataError for a damaged shard, a failed cache fetch) is raised by `next`, the
same object with its message, when the loop asks for the step whose input failed: the steps before it train,
that one does not. `data_wait_s` is the time `next` took: waiting for the thread (or, at depth 0, reading),
plus queuing the copies and the decode. On CUDA the copies run on the current stream, after the work queued
before them; the pinned source is released only once its copy is done (torch's caching host allocator).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from eyas.config import TrainConfig
from eyas.shards.encoding import TEACHER_KEYS, ShardEncoding, decode_aux
from eyas.shards.reader import ShardSamples
from eyas.train.data import ShardWindows, batch_at, collate, padded_length, rank_slice, split_micro_batches

POLL_S = 0.5  # how often a blocked put or get looks at the other side
# a shard's per-token tensor -> its batch key (eyas.objective.ttt_loss reads these)
BATCH_KEYS = {"input_ids": "input_ids", "loss_mask": "loss_mask", "aux_hidden_states": "aux_hidden",
              "aux_scales": "aux_scales", **TEACHER_KEYS}  # fmt: skip


@dataclass
class HostStep:
    """One step's input on the host: the data position it follows, the epoch, the global batch ids, and this
    rank's micro-batches (collated, aux as stored; pinned on CUDA)."""

    position: int
    epoch: int
    ids: list[int]
    micro_batches: list[dict[str, torch.Tensor]]


@dataclass
class StepInput:
    epoch: int
    ids: list[int]
    micro_batches: list[dict[str, torch.Tensor]]  # on the device, aux decoded
    wait_s: float  # seconds the loop waited for it


def host_micro_batches(
    samples: list[dict], *, max_len: int, min_len: int, micro_batch_tokens: int, pin_memory: bool
) -> list[dict[str, torch.Tensor]]:
    """Samples collated into micro-batches of at most `micro_batch_tokens` padded tokens (eyas.train.data
    split_micro_batches), each cut to max_len and at least min_len wide; in pinned memory when asked."""
    lengths = [padded_length(int(s["input_ids"].shape[0]), max_len, min_len) for s in samples]
    return [
        collate([samples[i] for i in group], max_len, min_len=min_len, pin_memory=pin_memory)
        for group in split_micro_batches(lengths, micro_batch_tokens)
    ]


def read_micro_batches(
    samples: ShardSamples, ids: list[int], *, max_len: int, min_len: int, micro_batch_tokens: int, pin_memory: bool
) -> list[dict[str, torch.Tensor]]:
    """host_micro_batches over the samples `ids` as stored (float8 aux with their scales), each sample read straight
    into its batch row (ShardSamples.read_sample_into): the batches collate makes, without a copy in between."""
    stored = samples.stored_tensors()
    counts = [min(samples.num_tokens(i), max_len) for i in ids]
    lengths = [padded_length(n, max_len, min_len) for n in counts]
    out = []
    for group in split_micro_batches(lengths, micro_batch_tokens):
        width = max(lengths[i] for i in group)
        batch = {name: torch.empty((len(group), width, *t.row_shape), dtype=t.dtype, pin_memory=pin_memory)
                 for name, t in stored.items()}  # fmt: skip
        for row, i in enumerate(group):  # every byte written once: the rows read, then zeros past them
            samples.read_sample_into(ids[i], {name: batch[name][row, : counts[i]] for name in stored})
            for name in stored:
                batch[name][row, counts[i] :].zero_()
        valid = torch.arange(width)[None, :] < torch.tensor([counts[i] for i in group])[:, None]
        out.append(
            {BATCH_KEYS[name]: batch[name] for name in stored} | {"valid": valid.pin_memory() if pin_memory else valid}
        )
    return out


@dataclass(frozen=True)
class RankSteps:
    """The steps one rank trains, built on the host: the step after `position` samples consumed takes the
    global batch of the order (eyas.train.data.batch_at over `train_ids`), this rank's share of it, read with
    float8 aux as stored, in micro-batches at least num_ttt_steps + 1 wide (ttt_loss needs more columns than
    unroll steps; padding is masked out, so this changes no result)."""

    samples: ShardSamples
    train_ids: Sequence[int]
    train: TrainConfig
    windows: ShardWindows
    rank: int
    world: int
    max_len: int
    micro_batch_tokens: int
    pin_memory: bool

    def __call__(self, position: int) -> HostStep:
        t = self.train
        epoch, positions = batch_at(position, len(self.train_ids), t.global_batch_size, t.seed, self.windows)
        ids = [self.train_ids[i] for i in positions]
        mine = rank_slice(ids, self.rank, self.world)
        batches = read_micro_batches(self.samples, mine, max_len=self.max_len, min_len=t.num_ttt_steps + 1,
                                     micro_batch_tokens=self.micro_batch_tokens, pin_memory=self.pin_memory)  # fmt: skip
        return HostStep(position, epoch, ids, batches)


def to_device(batch: dict[str, torch.Tensor], device: torch.device, encoding: ShardEncoding, *, num_aux: int) -> dict:
    """A collated batch on `device` (non-blocking copies from pinned memory), float8 aux decoded there by
    eyas.shards.encoding.decode_aux (on a CPU device, on the CPU: the same function)."""
    moved = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    scales = moved.pop("aux_scales", None)
    if scales is not None:
        stored = {"aux_hidden_states": moved["aux_hidden"], "aux_scales": scales}
        moved["aux_hidden"] = decode_aux(stored, encoding, num_aux=num_aux)
    return moved


class InputPipeline:
    """The steps at `positions`, in order, built by `build` `depth` steps ahead in a thread (0 = in the loop)."""

    def __init__(
        self,
        build: Callable[[int], HostStep],
        positions: Iterable[int],
        *,
        depth: int,
        device: torch.device,
        encoding: ShardEncoding,
        num_aux: int,
    ):
        if depth < 0:
            raise ValueError(f"input pipeline: depth {depth}, expected 0 (in the loop) or more steps ahead")
        self.build, self.depth, self.device = build, depth, device
        self.encoding, self.num_aux = encoding, num_aux
        self._positions = iter(positions)
        self._stopping = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._thread = None
        if depth:
            self._thread = threading.Thread(target=self._run, name="eyas-input-pipeline", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        for position in self._positions:
            if self._stopping.is_set():
                return
            try:
                item = self.build(position)
            except BaseException as err:  # handed to the loop, which raises it at this step
                item = err
            while not self._stopping.is_set():
                try:
                    self._queue.put(item, timeout=POLL_S)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def _take(self) -> HostStep:
        if not self.depth:
            position = next(self._positions, None)
            if position is None:
                raise RuntimeError("input pipeline: the loop asked for a step past the last position it was given")
            return self.build(position)
        while True:
            try:
                item = self._queue.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError(
                        "input pipeline: the loop asked for a step past the last position it was given"
                    ) from None
        if isinstance(item, BaseException):
            raise item
        return item

    def next(self, position: int) -> StepInput:
        """The step that follows `position` samples consumed, on the device; raises what building it raised."""
        start = time.perf_counter()
        host = self._take()
        if host.position != position:
            raise RuntimeError(
                f"input pipeline: built the step after {host.position} samples, the loop is at {position}; "
                "the pipeline must start at the resumed position"
            )
        batches = [to_device(b, self.device, self.encoding, num_aux=self.num_aux) for b in host.micro_batches]
        return StepInput(host.epoch, host.ids, batches, time.perf_counter() - start)

    def stop(self) -> None:
        """Ask the thread to stop after the step it builds, and release what it queued."""
        self._stopping.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def join(self, timeout_s: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def close(self) -> None:
        self.stop()
        self.join()
