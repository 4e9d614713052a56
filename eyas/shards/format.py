"""Hidden-state shard files: the plan (which samples go into which shard), the file format, writing and reading.

A shard is `shard-{index:05d}.safetensors` holding a run of whole samples packed along the token
axis (`input_ids` int64 [T], `loss_mask` uint8 [T], `sample_offsets` int64 [n+1], `sample_indices`
int64 [n], and the feature tensors of its encoding, eyas.shards.encoding: `aux_hidden_states`
[T, n_aux*H] (+ `aux_scales` with float8), and `last_hidden_states` [T, H] or the top-K teacher) with
string `__metadata__` (see `ShardMeta`). Which samples go into which shard (`plan_shards`) depends
only on the sample order and the shard size, never on the number of workers.

The bytes of a shard are a pure function of its tensors and metadata (`serialize_shard`: header
keys sorted, tensors ordered by alignment then name), so an interrupted and resumed extraction
writes the same files as an uninterrupted one. Durability: a shard is written through
`eyas.storage` (temporary -> fsync -> rename, or one S3 object); only then is its manifest row
recorded (eyas.shards.manifest). A shard file without a manifest row is therefore an unfinished write.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Sequence

import torch

from eyas.checksum import checksum_bytes
from eyas.fsio import serialize_safetensors
from eyas.shards.encoding import TOKEN_OVERHEAD_BYTES, ShardEncoding, extract_encoding  # noqa: F401 (TOKEN_OVERHEAD_BYTES re-exported)
from eyas.shards.manifest import ManifestRow
from eyas.storage import Storage, as_storage

FORMAT_VERSION = "2"
SHARD_NAME_RE = re.compile(r"^shard-(\d{5,})\.safetensors$")
# The tensors every shard holds besides its encoding's feature tensors.
BASE_TENSOR_NAMES = ("input_ids", "loss_mask", "sample_offsets", "sample_indices")


def shard_filename(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def bytes_per_token(*, hidden_size: int, num_aux: int, dtype: str) -> int:
    """Shard bytes per token with every hidden state in `dtype` and the last_hidden teacher: (n_aux + 1) * H
    values plus TOKEN_OVERHEAD_BYTES (other encodings: eyas.shards.encoding.ShardEncoding.bytes_per_token)."""
    enc = ShardEncoding(aux_dtype=dtype, teacher="last_hidden", teacher_topk=0, dtype=dtype)
    return enc.bytes_per_token(hidden_size=hidden_size, num_aux=num_aux)


@dataclass(frozen=True)
class ShardPlan:
    index: int
    sample_start: int
    sample_end: int  # exclusive
    num_tokens: int


def plan_shards(num_tokens_per_sample: Sequence[int], bytes_per_token: int, shard_bytes: int) -> list[ShardPlan]:
    """Pack whole samples, in order, into shards of at most `shard_bytes` (a sample larger than that
    gets a shard of its own). A pure function of the sample lengths and the shard size."""
    if bytes_per_token < 1 or shard_bytes < 1:
        raise ValueError(f"plan_shards: bytes_per_token={bytes_per_token} and shard_bytes={shard_bytes} must be >= 1")
    plans: list[ShardPlan] = []
    start, tokens = 0, 0
    for i, n in enumerate(num_tokens_per_sample):
        if n < 1:
            raise ValueError(f"sample {i}: num_tokens={n}, expected >= 1; drop empty samples from the dataset")
        if i > start and (tokens + n) * bytes_per_token > shard_bytes:
            plans.append(ShardPlan(len(plans), start, i, tokens))
            start, tokens = i, 0
        tokens += n
    if tokens:
        plans.append(ShardPlan(len(plans), start, len(num_tokens_per_sample), tokens))
    return plans


def extraction_plan(extract_cfg, facts) -> list[ShardPlan]:
    """The shard plan of an extraction (an ExtractConfig) over a run's facts (eyas.facts.RunFacts: the sample
    lengths, hidden size and aux layer count): known before anything is extracted, so a streamed trainer's job
    carries it too."""
    bytes_per_token = extract_encoding(extract_cfg).bytes_per_token(hidden_size=facts.hidden_size,
                                                                     num_aux=facts.num_aux)  # fmt: skip
    return plan_shards(facts.sample_lengths(), bytes_per_token, extract_cfg.shard_bytes)


@dataclass(frozen=True)
class ShardMeta:
    """The `__metadata__` of a shard (stored as strings; `aux_layer_ids` as a JSON list). `dtype` is the teacher
    values' dtype; `aux_dtype`, `teacher` and `teacher_topk` complete the encoding (eyas.shards.encoding)."""

    target_fingerprint: str
    aux_layer_ids: tuple[int, ...]
    layer_id_convention: str
    hidden_size: int
    num_aux: int
    dtype: str
    backend: str
    dataset_hash: str
    shard_index: int
    sample_start: int
    sample_end: int
    aux_dtype: str = ""  # empty: the same as dtype
    teacher: str = "last_hidden"
    teacher_topk: int = 0
    format_version: str = FORMAT_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_dtype", self.aux_dtype or self.dtype)

    @property
    def encoding(self) -> ShardEncoding:
        return ShardEncoding(self.aux_dtype, self.teacher, self.teacher_topk, self.dtype)

    def tensor_names(self) -> list[str]:
        """Every tensor a shard with this metadata holds, sorted."""
        features = self.encoding.feature_layout(0, num_aux=self.num_aux, hidden_size=self.hidden_size)
        return sorted([*BASE_TENSOR_NAMES, *features])

    def to_metadata(self) -> dict[str, str]:
        out = {k: str(v) for k, v in asdict(self).items()}
        out["aux_layer_ids"] = json.dumps(list(self.aux_layer_ids))
        return out

    @classmethod
    def from_metadata(cls, metadata: dict[str, str] | None, *, source: str) -> "ShardMeta":
        metadata = metadata or {}
        names = [f.name for f in fields(cls)]
        missing = sorted(set(names) - set(metadata))
        if missing:
            raise ValueError(
                f"{source}: __metadata__ lacks keys {missing}; expected all of {sorted(names)}; "
                f"the file was not written by eyas.shards.format.write_shard: re-extract it"
            )
        try:
            ids = json.loads(metadata["aux_layer_ids"])
            values = {n: metadata[n] for n in names}
            values["aux_layer_ids"] = tuple(int(i) for i in ids)
            for n in ("hidden_size", "num_aux", "shard_index", "sample_start", "sample_end", "teacher_topk"):
                values[n] = int(values[n])
            meta = cls(**values)
            meta.encoding  # noqa: B018 (raises ValueError naming a malformed encoding)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{source}: __metadata__ has a malformed value ({e}); re-extract the shard") from e
        return meta


def serialize_shard(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytearray:
    """safetensors bytes that depend only on the tensors and the metadata (eyas.fsio.serialize_safetensors)."""
    return serialize_safetensors(tensors, metadata)


def write_shard(where: "str | Path | Storage", tensors: dict[str, torch.Tensor], meta: ShardMeta) -> ManifestRow:
    """Write one shard durably and return its manifest row (the caller records it: eyas.shards.manifest)."""
    if sorted(tensors) != meta.tensor_names():
        raise ValueError(f"shard {meta.shard_index:05d}: tensors {sorted(tensors)}, expected {meta.tensor_names()}")
    data = serialize_shard(tensors, meta.to_metadata())
    name = shard_filename(meta.shard_index)
    as_storage(where).put_bytes(name, data)
    return ManifestRow(
        shard_index=meta.shard_index,
        file=name,
        sample_start=meta.sample_start,
        sample_end=meta.sample_end,
        num_tokens=int(tensors["input_ids"].shape[0]),
        num_bytes=len(data),
        checksum=checksum_bytes(data),
    )


def shard_names(shards_dir: Path) -> list[str]:
    """The names of the `*.safetensors` files in the directory (not temporaries, not the quarantine), sorted."""
    with os.scandir(shards_dir) as entries:
        return sorted(e.name for e in entries if e.name.endswith(".safetensors") and e.is_file())


def shard_files(shards_dir: Path) -> list[Path]:
    """The `*.safetensors` files in the directory (not temporaries, not the quarantine), sorted."""
    return [Path(shards_dir) / n for n in shard_names(shards_dir)]


def read_shard_layout(path: Path) -> tuple[ShardMeta, dict[str, tuple[str, tuple[int, ...]]]]:
    """A shard's parsed metadata and {tensor: (dtype, shape)}, from its header only."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = ShardMeta.from_metadata(f.metadata(), source=str(path))
        layout = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    return meta, layout


def load_shard(path: Path) -> tuple[dict[str, torch.Tensor], ShardMeta]:
    """All tensors of one shard and its parsed metadata. The tensors may be memory-mapped: do not
    modify the file in place while they live (eyas never does; it writes new files and renames)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = ShardMeta.from_metadata(f.metadata(), source=str(path))
        return {k: f.get_tensor(k) for k in f.keys()}, meta
