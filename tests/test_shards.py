"""Shard plan, file format, manifest, temporaries, quarantine and the tokenized-table reader."""

from __future__ import annotations

import random

import pytest
import torch
from run_fixtures import write_tokenized

from eyas.checksum import checksum_file
from eyas.dataset.table import TokenizedDataset
from eyas.shards.format import (
    TOKEN_OVERHEAD_BYTES,
    ShardMeta,
    ShardPlan,
    bytes_per_token,
    load_shard,
    plan_shards,
    shard_filename,
    write_shard,
)
from eyas.shards.manifest import MANIFEST_NAME, ManifestRow, append_manifest_row, read_manifest
from eyas.shards.shard_set import quarantine_shards
from eyas.storage.local import LocalStorage


def _meta(index=0, start=0, end=2):
    return ShardMeta(
        target_fingerprint="f00d",
        aux_layer_ids=(2, 4, 5),
        layer_id_convention="hf_hidden_states",
        hidden_size=4,
        num_aux=3,
        dtype="float32",
        backend="hf",
        dataset_hash="d5e7",
        shard_index=index,
        sample_start=start,
        sample_end=end,
    )


def _tensors(lengths=(3, 2), hidden=4, num_aux=3):
    t = sum(lengths)
    return {
        "input_ids": torch.arange(t, dtype=torch.int64),
        "loss_mask": torch.ones(t, dtype=torch.uint8),
        "aux_hidden_states": torch.randn(t, num_aux * hidden),
        "last_hidden_states": torch.randn(t, hidden),
        "sample_offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
        "sample_indices": torch.arange(len(lengths), dtype=torch.int64),
    }


def test_plan_packs_whole_samples_within_shard_bytes():
    rng = random.Random(0)
    lengths = [rng.randint(1, 50) for _ in range(300)]
    plan = plan_shards(lengths, 10, 1000)
    assert plan[0].sample_start == 0 and plan[-1].sample_end == len(lengths)
    for a, b in zip(plan, plan[1:]):
        assert a.sample_end == b.sample_start  # contiguous: no sample lost, split or duplicated
    for p in plan:
        assert p.num_tokens == sum(lengths[p.sample_start : p.sample_end])
        assert p.num_tokens * 10 <= 1000
        if p.sample_end < len(lengths):  # greedy: the next sample would not have fit
            assert (p.num_tokens + lengths[p.sample_end]) * 10 > 1000
    assert [p.index for p in plan] == list(range(len(plan)))


def test_plan_is_the_same_for_any_worker_count():
    lengths = [random.Random(1).randint(1, 40) for _ in range(200)]
    plan = plan_shards(lengths, 8, 2000)
    for num_workers in (1, 2, 3, 8):
        # every worker computes the plan on its own and takes shards i % num_workers
        taken = sorted(
            (p for rank in range(num_workers) for p in plan_shards(lengths, 8, 2000)[rank::num_workers]),
            key=lambda p: p.index,
        )
        assert taken == plan


def test_plan_gives_an_oversized_sample_its_own_shard():
    plan = plan_shards([2, 500, 3], 1, 100)
    assert plan == [ShardPlan(0, 0, 1, 2), ShardPlan(1, 1, 2, 500), ShardPlan(2, 2, 3, 3)]


def test_plan_refuses_empty_sample():
    with pytest.raises(ValueError, match=r"sample 1: num_tokens=0, expected >= 1; drop empty samples"):
        plan_shards([3, 0, 2], 1, 100)


def test_bytes_per_token_counts_hidden_states_and_ids():
    assert bytes_per_token(hidden_size=4096, num_aux=3, dtype="bfloat16") == 32768 + TOKEN_OVERHEAD_BYTES


def test_write_shard_round_trips_and_leaves_no_temporary(tmp_path):
    tensors = _tensors()
    row = write_shard(tmp_path, tensors, _meta())
    path = tmp_path / shard_filename(0)
    assert row == ManifestRow(0, "shard-00000.safetensors", 0, 2, 5, path.stat().st_size, checksum_file(path))
    loaded, meta = load_shard(path)
    assert meta == _meta()
    for k, v in tensors.items():
        assert torch.equal(loaded[k], v), k
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.safetensors"]


def test_write_shard_refuses_missing_tensor(tmp_path):
    tensors = _tensors()
    del tensors["loss_mask"]
    with pytest.raises(ValueError, match=r"shard 00000: tensors \[.*\], expected \[.*'loss_mask'"):
        write_shard(tmp_path, tensors, _meta())


def test_manifest_appends_and_refuses_duplicate(tmp_path):
    assert read_manifest(tmp_path) == []
    rows = [write_shard(tmp_path, _tensors(), _meta(i, 2 * i, 2 * i + 2)) for i in (1, 0)]
    for r in rows:
        append_manifest_row(tmp_path, r)
    assert [r.shard_index for r in read_manifest(tmp_path)] == [0, 1]
    with pytest.raises(ValueError, match=r"shard 00001 already has a row; quarantine it"):
        append_manifest_row(tmp_path, rows[0])
    assert not list(tmp_path.glob(".*tmp-*"))


def test_remove_stray_temporaries_keeps_shards(tmp_path):
    write_shard(tmp_path, _tensors(), _meta())
    (tmp_path / ".shard-00001.safetensors.tmp-4242").write_bytes(b"partial")
    (tmp_path / f".{MANIFEST_NAME}.tmp-7").write_bytes(b"partial")
    removed = LocalStorage(tmp_path).remove_partial()
    assert sorted(removed) == [".manifest.parquet.tmp-7", ".shard-00001.safetensors.tmp-4242"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.safetensors"]


def test_quarantine_moves_file_and_drops_row(tmp_path):
    for i in (0, 1):
        append_manifest_row(tmp_path, write_shard(tmp_path, _tensors(), _meta(i, 2 * i, 2 * i + 2)))
    notes = quarantine_shards(tmp_path, {"shard-00001.safetensors": "shard-00001.safetensors: checksum mismatch"})
    assert [n.split("/")[0] for n in notes] == ["quarantine"]
    assert (tmp_path / notes[0]).read_text() == "shard-00001.safetensors: checksum mismatch\n"
    assert (tmp_path / notes[0].removesuffix(".reason.txt")).is_file()
    assert not (tmp_path / "shard-00001.safetensors").exists()
    assert [r.shard_index for r in read_manifest(tmp_path)] == [0]


def test_shard_meta_names_missing_keys():
    metadata = _meta().to_metadata()
    del metadata["dataset_hash"]
    with pytest.raises(ValueError, match=r"x.safetensors: __metadata__ lacks keys \['dataset_hash'\]"):
        ShardMeta.from_metadata(metadata, source="x.safetensors")


def test_tokenized_dataset_reads_tokens(tmp_path):
    ds = TokenizedDataset(write_tokenized(tmp_path / "t.parquet", [[5, 6, 7], [8, 9]]))
    assert (len(ds), ds.num_tokens, ds.dataset_hash) == (2, [3, 2], "d5e7")
    ids, mask = ds.tokens(1, 2)
    assert ids.tolist() == [8, 9] and ids.dtype == torch.int64
    assert mask.tolist() == [0, 1] and mask.dtype == torch.uint8


def test_tokenized_dataset_requires_content_hash(tmp_path):
    path = write_tokenized(tmp_path / "t.parquet", [[5, 6]], dataset_hash=None)
    with pytest.raises(ValueError, match=r"schema metadata lacks 'eyas.content_hash'"):
        TokenizedDataset(path)


def test_tokenized_dataset_requires_ordered_sample_index(tmp_path):
    path = write_tokenized(tmp_path / "t.parquet", [[5], [6]], sample_index=[1, 0])
    with pytest.raises(ValueError, match=r"sample_index is not 0..1 in order"):
        TokenizedDataset(path)
