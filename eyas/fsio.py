"""Durable writes: what a crash at any instant leaves is either the old file (or directory) or the new one.

A temporary is named `.{name}.tmp-{pid}` beside its destination (`TMP_MARKER` finds strays); a directory
is written into such a temporary and put in place whole by `replace_dir`.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

TMP_MARKER = ".tmp-"


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    """The temporary name of `path` for this process."""
    path = Path(path)
    return path.with_name(f".{path.name}{TMP_MARKER}{os.getpid()}")


def commit_temp(tmp: Path, path: Path) -> None:
    """fsync a finished temporary, rename it over `path`, fsync the directory."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(Path(path).parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    tmp = temp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
    commit_temp(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def replace_dir(temp: Path, final: Path) -> None:
    """Put the finished directory `temp` in place of `final` (which may exist): every file and `temp` fsynced,
    `final` renamed aside, `temp` renamed to `final`, the parent fsynced, the old one deleted. A crash leaves
    either the old directory or the new one at `final` (and strays with TMP_MARKER beside it)."""
    temp, final = Path(temp), Path(final)
    for path in temp.iterdir():
        fsync_path(path)
    fsync_path(temp)
    old = final.with_name(f".{final.name}.old{TMP_MARKER}{os.getpid()}")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    temp.rename(final)
    fsync_path(final.parent)
    if old.exists():
        shutil.rmtree(old)


def read_json_record(path: Path) -> dict | None:
    """A JSON record eyas wrote with atomic_write_text, or None when there is none. A record that does not parse
    was written by something else (writes here are atomic): the error names the file."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: not valid JSON ({e}); eyas writes this file whole, so something else changed it: "
            "delete it to have the stage write it again"
        ) from e


MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own bound on a header
SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                        "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (names, dtypes, shapes, byte offsets): its length checked against
    the format's bound and the file's size before anything is read, its JSON an object."""
    return _header_and_data_bytes(path)[0]


def _header_and_data_bytes(path: Path) -> tuple[dict, int]:
    """(the checked header, the bytes after it) of a safetensors file, in one open."""
    with open(path, "rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        file_size = os.fstat(f.fileno()).st_size
        if not 2 <= size <= min(MAX_HEADER_BYTES, file_size - 8):
            raise ValueError(
                f"{path}: not a safetensors file (header length {size}, file size {file_size} bytes); expected "
                "safetensors weights (an 8-byte header length, then that many bytes of JSON)"
            )
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(
                f"{path}: safetensors header is not JSON ({err}); the file is damaged or foreign"
            ) from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is a {type(header).__name__}, expected a JSON object")
    return header, file_size - 8 - size


def checked_safetensors_header(path: Path) -> dict:
    """read_safetensors_header, and every tensor entry checked against the file before a reader trusts it:
    a known dtype, a shape of non-negative integers, offsets inside the file's data that match dtype x shape,
    no two tensors overlapping. For files eyas did not write (drafters, a target's weights)."""
    path = Path(path)
    header, data = _header_and_data_bytes(path)
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: entry {entry!r:.80} is not an object; the file is damaged or foreign")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in SAFETENSORS_ITEMSIZE:
            raise ValueError(f"{where}: dtype {dtype!r}, expected one of {sorted(SAFETENSORS_ITEMSIZE)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"{where}: shape {shape!r:.80}, expected a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data):  # fmt: skip
            raise ValueError(
                f"{where}: data_offsets {offsets!r:.80}, expected [start, end] with 0 <= start <= end <= {data} "
                "(the bytes after the header); the file is truncated or damaged"
            )
        count = 1
        for d in shape:
            count *= d
        if offsets[1] - offsets[0] != count * SAFETENSORS_ITEMSIZE[dtype]:
            raise ValueError(
                f"{where}: {offsets[1] - offsets[0]} bytes for {dtype} {shape} ({count * SAFETENSORS_ITEMSIZE[dtype]} "
                "expected); the file is damaged"
            )
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
        if b0 < a1 and b1 > b0 and a1 > a0:
            raise ValueError(f"{path}: tensors {a!r} and {b!r} overlap (bytes {b0}..{a1}); the file is damaged")
    return header


# torch dtype (by name: this module does not import torch) -> safetensors dtype
SAFETENSORS_DTYPES = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16", "torch.int64": "I64",
                      "torch.int32": "I32", "torch.uint8": "U8", "torch.bool": "BOOL", "torch.float8_e4m3fn": "F8_E4M3"}  # fmt: skip


def serialize_safetensors(tensors: dict, metadata: dict[str, str]) -> bytearray:
    """safetensors bytes that depend only on the tensors and the metadata: header keys sorted (the metadata's
    too: safetensors' own writer orders them by hash), tensors laid out by descending item size then name (so
    each is aligned to its dtype). Shards, the vocab mapping: every file eyas writes this way is byte-for-byte
    the same for the same inputs."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        t = tensors[name]
        if str(t.dtype) not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype}, expected one of {list(SAFETENSORS_DTYPES)}")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(t.dtype)], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    head += b" " * (-len(head) % 8)
    out = bytearray(8 + len(head) + offset)
    out[:8] = struct.pack("<Q", len(head))
    out[8 : 8 + len(head)] = head
    pos = 8 + len(head)
    for name in order:
        t = tensors[name].detach().cpu().contiguous().reshape(-1)
        size = t.numel() * t.element_size()
        if size:
            import torch

            out[pos : pos + size] = t.view(torch.uint8).numpy().data
        pos += size
    return out
