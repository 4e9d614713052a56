"""The checks of shard verification: each takes one shard's state and raises `Bad` with the reason.

Headers are parsed here (8-byte little-endian length, JSON), not through `safe_open`, so cheap mode
costs one open, two small reads and a few small `pread`s per shard: of a local file (`FileBytes`), or
range requests to an object in storage (`RangeBytes`, one per read). Full mode reads every byte once,
in chunks of `chunk_bytes` into a buffer reused by the thread: each chunk feeds the checksum and, inside
the float tensors (hidden states, float8 scales, top-K log-probabilities), an exact finiteness test on the
exponent bits (float32, bfloat16, float16; float8 e4m3fn, which has NaN and no inf). The encoding's own
values are checked after: float8 scales positive, top-K ids non-negative, log-probabilities <= 0.
A chunk that fits the core's cache (the default 512 KiB) is read from memory once, by the copy out of
the page cache; the hash and the finiteness test then find it in cache.
Memory per shard in flight is one chunk, whatever the shard's size.
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np

from eyas.checksum import format_digest, new_hasher, short
from eyas.dataset.table import TokenizedDataset
from eyas.layer_ids import LAYER_ID_CONVENTION
from eyas.shards.format import FORMAT_VERSION, ShardMeta, shard_filename
from eyas.shards.manifest import ManifestRow

ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1}  # fmt: skip
# Unsigned and signed views, mask dropping the sign, smallest pattern with an all-ones exponent (inf;
# above it NaN), and the sign bit.
_NONFINITE = {
    "F32": (np.uint32, np.int32, 0x7FFFFFFF, 0x7F800000, 0x80000000),
    "BF16": (np.uint16, np.int16, 0x7FFF, 0x7F80, 0x8000),
    "F16": (np.uint16, np.int16, 0x7FFF, 0x7C00, 0x8000),
    "F8_E4M3": (np.uint8, np.int8, 0x7F, 0x7F, 0x80),  # e4m3fn: S.1111.111 is NaN, there is no inf
}
FLOAT_TENSORS = ("aux_hidden_states", "aux_scales", "last_hidden_states", "teacher_topk_logprobs")
MAX_HEADER_BYTES = 100 << 20
HEAD_READ_BYTES = 16 << 10
FIX = "quarantine the shard (eyas.shards.shard_set.quarantine_shards) and re-run extraction"


class Bad(Exception):
    """One failed check; the message is the shard's reason."""


@dataclass(frozen=True)
class ExpectedShardMeta:
    """What the run config says every shard's metadata must be."""

    target_fingerprint: str
    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    num_aux: int
    dtype: str
    dataset_hash: str
    layer_id_convention: str = LAYER_ID_CONVENTION
    aux_dtype: str = ""  # empty: the same as dtype
    teacher: str = "last_hidden"
    teacher_topk: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_dtype", self.aux_dtype or self.dtype)


@dataclass(frozen=True)
class VerifyContext:
    """What every shard is checked against, shared read-only by the worker threads."""

    expected: ExpectedShardMeta
    dataset: TokenizedDataset | None  # the token columns, read for full mode only
    token_starts: np.ndarray  # [num_samples + 1]: first token of each sample, packed as extraction packs them
    chunk_bytes: int


class TensorSpan(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte positions in the file
    end: int


class FileBytes:
    """A shard's bytes in a local file, read by pread (os.pread releases the GIL)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size

    def pread(self, n: int, offset: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def readinto(self, buf: memoryview, offset: int) -> int:
        return os.preadv(self.fd, [buf], offset)

    def close(self) -> None:
        os.close(self.fd)


class RangeBytes:
    """A shard's bytes in storage (S3), each read one range request (`Storage.get_range`)."""

    def __init__(self, store, name: str, size: int):
        self.store, self.name, self.size = store, name, size

    def pread(self, n: int, offset: int) -> bytes:
        end = min(offset + n, self.size)
        return self.store.get_range(self.name, offset, end) if offset < end else b""

    def readinto(self, buf: memoryview, offset: int) -> int:
        data = self.pread(len(buf), offset)
        buf[: len(data)] = data
        return len(data)

    def close(self) -> None:
        pass


@dataclass
class ShardState:
    name: str
    row: ManifestRow | None
    ctx: VerifyContext
    opener: Callable[[], "FileBytes | RangeBytes"]  # raises FileNotFoundError when the shard is absent
    src: "FileBytes | RangeBytes | None" = None
    size: int = 0
    data_start: int = 0
    raw_meta: dict | None = None
    meta: ShardMeta | None = None
    tensors: dict[str, TensorSpan] = field(default_factory=dict)
    offsets: np.ndarray | None = None
    nonfinite: str = ""  # set by check_checksum's pass, raised by check_finite

    def read(self, span: TensorSpan, dtype: str) -> np.ndarray:
        return self.read_pair(span, span, dtype)[0]

    def read_pair(self, a: TensorSpan, b: TensorSpan, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """Two tensors, in one read when they are near each other (offsets and indices are adjacent)."""
        lo, hi = min(a.start, b.start), max(a.end, b.end)
        if hi - lo > (a.end - a.start) + (b.end - b.start) + HEAD_READ_BYTES:
            return self.read(a, dtype), self.read(b, dtype)
        data = self.src.pread(hi - lo, lo)
        if len(data) != hi - lo:
            raise Bad(f"file ended inside tensor bytes {lo}..{hi} (truncated); {FIX}")
        item = np.dtype(dtype).itemsize
        return tuple(
            np.frombuffer(data, dtype=dtype, count=(t.end - t.start) // item, offset=t.start - lo) for t in (a, b)
        )

    def sample_of(self, token: int) -> int:
        return self.row.sample_start + int(np.searchsorted(self.offsets, token, side="right")) - 1


def check_listed(s: ShardState) -> None:
    try:
        s.src = s.opener()
    except FileNotFoundError:
        if s.row is None:
            raise
        raise Bad(f"listed in the manifest but missing on disk; {FIX}") from None
    s.size = s.src.size
    if s.row is None:
        raise Bad(
            "not in the manifest: an unfinished write (crash before its manifest row) or a foreign file; "
            "the next extraction run rewrites it, or quarantine it"
        )


def check_header(s: ShardState) -> None:
    head = s.src.pread(HEAD_READ_BYTES, 0)  # the header of a shard usually fits: one read
    n = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
    if n < 2 or n > min(MAX_HEADER_BYTES, s.size - 8):
        raise Bad(
            f"safetensors header does not parse (header length {n}, file size {s.size} bytes): not a safetensors "
            f"file, or truncated; {FIX}"
        )
    try:
        header = json.loads(head[8 : 8 + n] if 8 + n <= len(head) else s.src.pread(n, 8))
        s.raw_meta = header.pop("__metadata__", None)
        s.data_start = 8 + n
        s.tensors = {
            name: TensorSpan(
                str(t["dtype"]), tuple(map(int, t["shape"])), *(s.data_start + int(o) for o in t["data_offsets"])
            )
            for name, t in header.items()
        }
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise Bad(f"safetensors header does not parse ({type(e).__name__}: {e}); {FIX}") from e
    try:
        s.meta = ShardMeta.from_metadata(s.raw_meta, source="header")
    except ValueError as e:
        raise Bad(str(e)) from e
    if s.meta.format_version != FORMAT_VERSION:
        raise Bad(f"format_version {s.meta.format_version!r}, expected {FORMAT_VERSION!r}; {FIX}")


def check_identity(s: ShardState) -> None:
    """The file holds the shard its name and manifest row say (catches swapped or renamed files)."""
    m, r = s.meta, s.row
    if (m.shard_index, m.sample_start, m.sample_end) != (r.shard_index, r.sample_start, r.sample_end) or (
        s.name != shard_filename(m.shard_index)
    ):
        raise Bad(
            f"the file holds shard {m.shard_index} (samples {m.sample_start}..{m.sample_end}), but its name and "
            f"the manifest say shard {r.shard_index} (samples {r.sample_start}..{r.sample_end}): files swapped "
            f"or renamed; {FIX}"
        )


def check_size(s: ShardState) -> None:
    if s.size != s.row.num_bytes:
        raise Bad(f"file has {s.size} bytes, the manifest says {s.row.num_bytes} (truncated or overwritten); {FIX}")


def check_metadata(s: ShardState) -> None:
    m, e = s.meta, s.ctx.expected
    diffs = [
        f"{name} {found!r}, expected {want!r}"
        for name, found, want in [
            ("target_fingerprint", m.target_fingerprint, e.target_fingerprint),
            ("aux_layer_ids", list(m.aux_layer_ids), list(e.aux_layer_ids)),
            ("layer_id_convention", m.layer_id_convention, e.layer_id_convention),
            ("hidden_size", m.hidden_size, e.hidden_size),
            ("num_aux", m.num_aux, e.num_aux),
            ("dtype", m.dtype, e.dtype),
            ("aux_dtype", m.aux_dtype, e.aux_dtype),
            ("teacher", m.teacher, e.teacher),
            ("teacher_topk", m.teacher_topk, e.teacher_topk),
            ("dataset_hash", m.dataset_hash, e.dataset_hash),
        ]
        if found != want
    ]
    if diffs:
        raise Bad(
            f"metadata disagrees with the run config: {'; '.join(diffs)} "
            f"(extracted with another target, layer ids, encoding or dataset); {FIX}"
        )


def _expected_layout(s: ShardState) -> dict[str, tuple[str, tuple[int, ...]]]:
    m, t, n = s.meta, s.row.num_tokens, s.row.sample_end - s.row.sample_start
    return {
        "input_ids": ("I64", (t,)),
        "loss_mask": ("U8", (t,)),
        "sample_offsets": ("I64", (n + 1,)),
        "sample_indices": ("I64", (n,)),
        **m.encoding.feature_layout(t, num_aux=m.num_aux, hidden_size=m.hidden_size),
    }


def check_layout(s: ShardState) -> None:
    layout = _expected_layout(s)
    missing = sorted(set(layout) - set(s.tensors))
    unexpected = sorted(set(s.tensors) - set(layout))
    if missing or unexpected:
        raise Bad(
            f"tensors missing {missing}, unexpected {unexpected}; expected {sorted(layout)} (encoding "
            f"{s.meta.encoding.label()}); {FIX}"
        )
    m = s.meta
    for name, (dtype, shape) in layout.items():
        span = s.tensors[name]
        if span.dtype != dtype:
            raise Bad(
                f"{name} dtype {span.dtype}, expected {dtype} (encoding {m.encoding.label()}, dtype {m.dtype}); {FIX}"
            )
        if name == "aux_hidden_states" and span.shape[1:] != shape[1:]:
            width = span.shape[1] if len(span.shape) == 2 else list(span.shape[1:])
            raise Bad(
                f"aux_hidden_states width {width}, expected {shape[1]} ({m.num_aux} layers x "
                f"{m.hidden_size}); the backend did not return the aux layers' states "
                f"(see eyas.extract.backends.base.check_aux_width for causes); {FIX}"
            )
        if span.shape != shape:
            raise Bad(
                f"{name} shape {list(span.shape)}, expected {list(shape)} ({s.row.num_tokens} tokens, "
                f"{s.row.sample_end - s.row.sample_start} samples, H={m.hidden_size}); {FIX}"
            )
        if span.end - span.start != math.prod(shape) * ST_ITEMSIZE[dtype] or span.end > s.size:
            raise Bad(
                f"{name} occupies bytes {span.start}..{span.end} of {s.size}, expected {math.prod(shape)} "
                f"{dtype} values inside the file; the header is corrupt; {FIX}"
            )


def check_offsets(s: ShardState) -> None:
    r, starts = s.row, s.ctx.token_starts
    if r.sample_end >= len(starts):
        raise Bad(
            f"the manifest says samples {r.sample_start}..{r.sample_end}, the tokenized dataset has "
            f"{len(starts) - 1}; the shards belong to another dataset; {FIX}"
        )
    offsets, indices = s.read_pair(s.tensors["sample_offsets"], s.tensors["sample_indices"], "<i8")
    want = starts[r.sample_start : r.sample_end + 1] - starts[r.sample_start]
    if offsets.tobytes() != want.tobytes():  # both little-endian int64; bytes compare fast for tiny arrays
        _explain_offsets(offsets, want, r)
    if indices.tobytes() != np.arange(r.sample_start, r.sample_end, dtype="<i8").tobytes():
        raise Bad(f"sample_indices {indices.tolist()[:8]}..., expected {r.sample_start}..{r.sample_end - 1}; {FIX}")
    s.offsets = offsets


def _explain_offsets(offsets: np.ndarray, want: np.ndarray, r: ManifestRow) -> None:
    t = r.num_tokens
    if offsets[0] != 0 or offsets[-1] != t or not bool((offsets[1:] > offsets[:-1]).all()):
        raise Bad(
            f"sample_offsets {offsets.tolist()[:8]}{'...' if len(offsets) > 8 else ''} do not add up: expected "
            f"strictly increasing from 0 to the shard's {t} tokens; {FIX}"
        )
    lengths, want = np.diff(offsets), np.diff(want)
    i = int(np.flatnonzero(lengths != want)[0])
    raise Bad(
        f"sample_offsets do not add up: sample {r.sample_start + i} spans {int(lengths[i])} tokens, the "
        f"tokenized dataset has {int(want[i])}; {FIX}"
    )


_buffers = threading.local()


def _chunk_buffer(nbytes: int) -> memoryview:
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf) != nbytes:
        _buffers.buf = buf = bytearray(nbytes)
    return memoryview(buf)


def _regions(s: ShardState) -> list[tuple[int, int, str | None]]:
    """(start, end, tensor name or None) covering every byte of the file in order."""
    out, pos = [], 0
    for name, span in sorted(s.tensors.items(), key=lambda kv: kv[1].start):
        if span.start > pos:
            out.append((pos, span.start, None))
        out.append((span.start, span.end, name if name in FLOAT_TENSORS else None))
        pos = max(pos, span.end)
    if pos < s.size:
        out.append((pos, s.size, None))
    return out


def _first_nonfinite(chunk: memoryview, dtype: str) -> int:
    """Index of the first NaN/inf value in `chunk`, or -1 (integer tests on the exponent bits).

    The usual case (all finite) costs two max-reductions and no allocation: as unsigned integers the
    negative NaN/-inf patterns are the largest of all, as signed integers the positive NaN/+inf ones are.
    """
    utype, stype, mask, inf, sign = _NONFINITE[dtype]
    bits = np.frombuffer(chunk, dtype=utype)
    if bits.max(initial=0) < (inf | sign) and bits.view(stype).max(initial=0) < inf:
        return -1
    return int(np.flatnonzero((bits & utype(mask)) >= inf)[0])


def check_checksum(s: ShardState) -> None:
    """One pass over every byte: the checksum against the manifest, and the first non-finite hidden value."""
    h, buf = new_hasher(), _chunk_buffer(s.ctx.chunk_bytes)
    for start, end, name in _regions(s):
        span = s.tensors.get(name) if name else None
        item = ST_ITEMSIZE.get(span.dtype, 1) if span else 1
        step = max(item, len(buf) // item * item)
        for pos in range(start, end, step):
            n = s.src.readinto(buf[: min(step, end - pos)], pos)
            if n != min(step, end - pos):
                raise Bad(f"file ended at byte {pos + n}, expected {s.size} bytes (truncated while reading); {FIX}")
            h.update(buf[:n])
            if span is not None and span.dtype in _NONFINITE and not s.nonfinite:
                i = _first_nonfinite(buf[:n], span.dtype)
                if i >= 0:
                    token = ((pos - span.start) // item + i) // span.shape[1]
                    s.nonfinite = f"{name} has non-finite values (first at token {token}, sample {s.sample_of(token)})"
    digest = format_digest(h)
    if digest != s.row.checksum:
        raise Bad(
            f"checksum mismatch: {short(digest)}, the manifest says {short(s.row.checksum)} "
            f"(bytes changed after writing: disk or copy corruption); {FIX}"
        )


def check_finite(s: ShardState) -> None:
    if s.nonfinite:
        raise Bad(
            f"{s.nonfinite}; the target produced NaN/inf (float16 overflow? extract in bfloat16 or float32); {FIX}"
        )


def check_encoding(s: ShardState) -> None:
    """The encoding's own values: float8 scales > 0 (finite: check_finite), top-K ids >= 0, log-probs <= 0."""
    if "aux_scales" in s.tensors:
        scales = s.read(s.tensors["aux_scales"], "<f4")
        if scales.size and not scales.min() > 0:
            token = int(np.flatnonzero(~(scales > 0))[0]) // s.meta.num_aux
            raise Bad(
                f"aux_scales has a value {float(scales[~(scales > 0)][0])} <= 0 (token {token}, sample "
                f"{s.sample_of(token)}); a float8 scale is the layer's amax / 448 (1 for all zeros); {FIX}"
            )
    if "teacher_topk_ids" in s.tensors:
        ids = s.read(s.tensors["teacher_topk_ids"], "<i4")
        if ids.size and ids.min() < 0:
            token = int(np.flatnonzero(ids < 0)[0]) // s.meta.teacher_topk
            raise Bad(f"teacher_topk_ids has a negative id (token {token}, sample {s.sample_of(token)}); {FIX}")
        span = s.tensors["teacher_topk_logprobs"]
        logprobs = s.read(span, "<f4" if span.dtype == "F32" else "<f2")
        if logprobs.size and logprobs.max() > 1e-3:
            token = int(np.flatnonzero(logprobs > 1e-3)[0]) // s.meta.teacher_topk
            raise Bad(
                f"teacher_topk_logprobs has {float(logprobs.max())} > 0 (token {token}, sample {s.sample_of(token)}): "
                f"not log-probabilities (logits?); {FIX}"
            )


def check_dataset(s: ShardState) -> None:
    r = s.row
    ids, mask = s.ctx.dataset.tokens(r.sample_start, r.sample_end)
    for name, want, dtype in (("input_ids", ids.numpy(), "<i8"), ("loss_mask", mask.numpy(), "u1")):
        found = s.read(s.tensors[name], dtype)
        if not np.array_equal(found, want):
            token = int(np.flatnonzero(found != want)[0])
            raise Bad(
                f"{name} differs from the tokenized dataset at token {token} (sample {s.sample_of(token)}): shard "
                f"has {int(found[token])}, dataset has {int(want[token])}; the shard was extracted from "
                f"another dataset or for other samples; {FIX}"
            )


CHEAP_CHECKS = [
    ("listed", check_listed),
    ("header", check_header),
    ("identity", check_identity),
    ("size", check_size),
    ("metadata", check_metadata),
    ("layout", check_layout),
    ("offsets", check_offsets),
]
FULL_CHECKS = [
    *CHEAP_CHECKS,
    ("checksum", check_checksum),
    ("finite", check_finite),
    ("encoding", check_encoding),
    ("dataset", check_dataset),
]
