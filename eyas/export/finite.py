"""Every float value of a drafter's weights checked for NaN and inf, without torch, one chunk at a time.

    problems = nonfinite_problems(Path("export/sglang/model.safetensors"))   # [] when every value is finite

The values are read as unsigned integers and tested on their exponent bits (a NaN or inf has every exponent
bit set; float8 e4m3fn has NaN only, as S.1111.111), so bfloat16 and float8, which numpy has no type for, are
tested as exactly as float32. A chunk of `chunk_bytes` (16 MiB by default) is the only buffer, reused for
every tensor: memory stays flat whatever the drafter's size (a 1.2B-parameter drafter is 2.4 GB in bf16).
A safetensors file is read through its checked header (eyas.fsio); a pytorch_model.bin (EAGLE official's
drafts) through its pickle's tensor references (eyas.export.bin_weights), each storage's bytes streamed from
the zip archive.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import BinaryIO

import numpy as np

from eyas.fsio import SAFETENSORS_ITEMSIZE, checked_safetensors_header

CHUNK_BYTES = 16 << 20

# safetensors dtype -> (unsigned view, signed view, bits that hold a value's magnitude, the smallest magnitude that
# is NaN/inf, the smallest that is NaN)
_BITS = {
    "F64": (np.uint64, np.int64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000, 0x7FF0_0000_0000_0001),
    "F32": (np.uint32, np.int32, 0x7FFF_FFFF, 0x7F80_0000, 0x7F80_0001),
    "BF16": (np.uint16, np.int16, 0x7FFF, 0x7F80, 0x7F81),
    "F16": (np.uint16, np.int16, 0x7FFF, 0x7C00, 0x7C01),
    "F8_E5M2": (np.uint8, np.int8, 0x7F, 0x7C, 0x7D),
    "F8_E4M3": (np.uint8, np.int8, 0x7F, 0x7F, 0x7F),  # e4m3fn: S.1111.111 is NaN, there is no inf
}
# torch's typed storages in a pytorch_model.bin (eyas.export.bin_weights) -> safetensors dtype
_STORAGE_DTYPES = {"DoubleStorage": "F64", "FloatStorage": "F32", "BFloat16Storage": "BF16", "HalfStorage": "F16"}


@dataclass
class _Count:
    nan: int = 0
    inf: int = 0
    first: int = -1  # flat index of the first non-finite value


def _tally(count: _Count, bits: np.ndarray, dtype: str, start: int) -> None:
    """Add the NaN and inf among `bits` (values of `dtype` as unsigned integers, the first at flat index `start`)."""
    utype, stype, mask, inf, nan = _BITS[dtype]
    # the usual case (all finite) costs two max-reductions and no allocation: as unsigned integers the negative
    # NaN/-inf patterns are the largest of all, as signed integers the positive NaN/+inf ones are
    if bits.max(initial=0) < (inf | (mask + 1)) and bits.view(stype).max(initial=0) < inf:
        return
    magnitude = bits & utype(mask)
    bad = np.flatnonzero(magnitude >= inf)
    nans = int(np.count_nonzero(magnitude.reshape(-1)[bad] >= nan))
    if count.first < 0:
        count.first = start + int(bad[0])
    count.nan, count.inf = count.nan + nans, count.inf + len(bad) - nans


def _scan(read: BinaryIO, nbytes: int, dtype: str, buf: memoryview) -> _Count:
    """Count the NaN and inf among the next `nbytes` of `read` (values of `dtype`), a chunk at a time."""
    item = SAFETENSORS_ITEMSIZE[dtype]
    step = len(buf) // item * item
    count, done = _Count(), 0
    while done < nbytes:
        want, n = min(step, nbytes - done), 0
        while n < want and (got := read.readinto(buf[n:want])):
            n += got
        if n < want:
            raise ValueError(f"file ended {nbytes - done - n} bytes early inside a tensor; the file is truncated")
        _tally(count, np.frombuffer(buf[:n], dtype=_BITS[dtype][0]), dtype, done // item)
        done += n
    return count


def _problem(path: Path, name: str, shape: tuple[int, ...], count: _Count) -> str:
    where = [int(i) for i in np.unravel_index(count.first, shape)]
    return (
        f"{path.name}: tensor {name} {list(shape)} holds non-finite values ({count.nan:,} NaN, {count.inf:,} inf "
        f"of {prod(shape):,}; the first at {where}); expected finite weights: the training diverged before this "
        "checkpoint was saved, or the file was damaged after writing; export an earlier checkpoint (eyas remap "
        "CHECKPOINT DST --to FORMAT), or retrain with a lower train.lr"
    )


def nonfinite_problems(path: Path, *, chunk_bytes: int = CHUNK_BYTES) -> list[str]:
    """One problem per float tensor of the weights file `path` that holds NaN or inf, naming the tensor, the
    counts and the first position; [] when every value is finite. Integer tensors (d2t, t2d) are not read."""
    path = Path(path)
    buf = memoryview(bytearray(max(chunk_bytes, 8)))
    if path.suffix == ".bin":
        return _bin_problems(path, buf)
    header = checked_safetensors_header(path)
    tensors = sorted(
        ((e["data_offsets"][0], name, e) for name, e in header.items() if name != "__metadata__"),
        key=lambda t: t[0],
    )
    problems = []
    with open(path, "rb", buffering=0) as f:
        start = 8 + int.from_bytes(f.read(8), "little")
        for offset, name, entry in tensors:
            if entry["dtype"] not in _BITS:
                continue
            f.seek(start + offset)
            count = _scan(f, entry["data_offsets"][1] - offset, entry["dtype"], buf)
            if count.first >= 0:
                problems.append(_problem(path, name, tuple(entry["shape"]), count))
    return problems


def _bin_problems(path: Path, buf: memoryview) -> list[str]:
    """nonfinite_problems of a pytorch_model.bin: each tensor's elements read from its storage in the archive (a
    contiguous tensor a chunk at a time; a strided view, rare in a saved state dict, whole)."""
    from eyas.export.bin_weights import read_bin_refs

    refs = read_bin_refs(path)
    problems = []
    with zipfile.ZipFile(path) as archive:
        prefix = next(n for n in archive.namelist() if n.endswith("/data.pkl"))[: -len("data.pkl")]
        for name, ref in sorted(refs.items()):
            dtype = _STORAGE_DTYPES.get(ref.storage.type.name)
            if dtype is None or not prod(ref.shape):
                continue
            item, utype = SAFETENSORS_ITEMSIZE[dtype], _BITS[dtype][0]
            span = 1 + sum((d - 1) * s for d, s in zip(ref.shape, ref.stride))  # first to last element
            with archive.open(f"{prefix}data/{ref.storage.key}") as f:
                f.seek(ref.offset * item)
                if span == prod(ref.shape):
                    count = _scan(f, span * item, dtype, buf)
                else:
                    bits = np.frombuffer(f.read(span * item), dtype=utype)
                    strides = [s * item for s in ref.stride]
                    count = _Count()
                    _tally(count, np.lib.stride_tricks.as_strided(bits, ref.shape, strides, writeable=False), dtype, 0)
            if count.first >= 0:
                problems.append(_problem(path, name, ref.shape, count))
    return problems
