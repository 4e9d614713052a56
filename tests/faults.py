"""Damage done to a finished shard set, one kind at a time, as a disk, a person or a stray process does it:
the battery the verification and the pipeline must detect, quarantine and heal."""

from __future__ import annotations

import math
from pathlib import Path

KINDS = ("truncate", "flip", "delete", "stray", "swap", "metadata")


def apply_fault(shards: Path, kind: str, at: int = 0) -> None:
    """Damage the shard set in `shards`: kind is one of KINDS or "nan" (a NaN written with a valid checksum
    and manifest row: only a full read of the values finds it); `at` picks the shard (in name order)."""
    names = sorted(p.name for p in shards.glob("shard-*.safetensors"))
    first = shards / names[at]
    if kind == "truncate":
        first.write_bytes(first.read_bytes()[:-100])
    elif kind == "flip":
        data = bytearray(first.read_bytes())
        data[-7] ^= 0xFF
        first.write_bytes(bytes(data))
    elif kind == "delete":
        first.unlink()
    elif kind == "stray":
        (shards / "shard-99999.safetensors").write_bytes(b"not a shard")
    elif kind == "swap":
        second = shards / names[at + 1]
        tmp = shards / "swap.tmp"
        first.rename(tmp)
        second.rename(first)
        tmp.rename(second)
    elif kind == "metadata":  # one digit of the header's JSON changed in place: same size, same data
        data = bytearray(first.read_bytes())
        at_digit = data.index(b'"sample_start":"') + len(b'"sample_start":"') if b'"sample_start":"' in data else None
        assert at_digit is not None, "the header names sample_start"
        data[at_digit] = ord("9") if data[at_digit] != ord("9") else ord("8")
        first.write_bytes(bytes(data))
    elif kind == "nan":
        from eyas.shards.format import load_shard, write_shard
        from eyas.shards.manifest import read_manifest, write_manifest

        tensors, meta = load_shard(first)
        tensors = {k: v.clone() for k, v in tensors.items()}
        tensors["aux_hidden_states"][0, 0] = math.nan
        row = write_shard(shards, tensors, meta)
        write_manifest(shards, [row if r.file == row.file else r for r in read_manifest(shards)])
    else:
        raise ValueError(f"fault {kind!r}: expected one of {KINDS + ('nan',)}")
