"""Extraction with the hf backend: numbers, resume, crash leftovers, config mismatch, width check."""

from __future__ import annotations

import fcntl
import random
import shutil

import pytest
import torch
from run_fixtures import extract, write_tokenized

from eyas.checksum import checksum_file
from eyas.config import ExtractConfig
from eyas.extract.backends.base import AuxWidthError, check_aux_width
from eyas.shards.format import load_shard, shard_filename
from eyas.shards.manifest import read_manifest, write_manifest
from eyas.shards.shard_set import QUARANTINE_DIR, ExtractConfigMismatchError
from eyas.target import load_target, target_features

AUX_IDS = [2, 4, 5]  # the EAGLE-3 default of the 8-layer random target
CFG = ExtractConfig(shard_bytes=1 << 16, batch_size=3)  # ~63 tokens of H=64 float32 per shard


@pytest.fixture(scope="module")
def samples():
    rng = random.Random(0)
    return [[rng.randrange(1, 2048) for _ in range(rng.randint(4, 24))] for _ in range(12)]


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, samples):
    return write_tokenized(tmp_path_factory.mktemp("dataset") / "tokenized.parquet", samples)


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, tokenized, random_target_dir):
    """One finished extraction, shared; tests that change it work on a copy (`finished`)."""
    shards = tmp_path_factory.mktemp("extracted") / "shards"
    return shards, _extract(tokenized, shards, random_target_dir)


@pytest.fixture
def finished(tmp_path, extracted):
    shutil.copytree(extracted[0], tmp_path / "shards")
    return tmp_path / "shards"


def _extract(tokenized, shards_dir, target, cfg=CFG, **kw):
    return extract(tokenized, shards_dir, target, cfg, **kw)


def _stat(shards_dir):
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shards_dir.glob("shard-*.safetensors")}


def test_shards_equal_direct_features_per_sample(extracted, samples, random_target_dir):
    shards, summary = extracted
    assert summary.shards_total > 1 and summary.shards_written == summary.shards_total
    assert (summary.aux_layer_ids, summary.hidden_size) == (AUX_IDS, 64)
    assert summary.tokens_written == sum(map(len, samples))
    model = load_target(random_target_dir).model
    sample = 0
    for row in read_manifest(shards):
        tensors, meta = load_shard(shards / row.file)
        assert (meta.sample_start, meta.sample_end) == (row.sample_start, row.sample_end)
        assert list(meta.aux_layer_ids) == AUX_IDS
        assert tensors["sample_indices"].tolist() == list(range(row.sample_start, row.sample_end))
        offsets = tensors["sample_offsets"].tolist()
        for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
            ids = torch.tensor(samples[row.sample_start + i])
            aux, last, _ = target_features(model, ids[None], AUX_IDS)  # unpadded, one sample
            assert torch.equal(tensors["input_ids"][a:b], ids)
            torch.testing.assert_close(tensors["aux_hidden_states"][a:b], aux[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(tensors["last_hidden_states"][a:b], last[0], atol=1e-4, rtol=1e-4)
            sample += 1
    assert sample == len(samples)


def test_rerun_skips_finished_shards(finished, tokenized, random_target_dir):
    before = _stat(finished)
    summary = _extract(tokenized, finished, random_target_dir)
    assert (summary.shards_written, summary.shards_skipped) == (0, summary.shards_total)
    assert _stat(finished) == before  # same inodes and mtimes: nothing rewritten


def test_crash_mid_run_resumes_with_another_batch_size(tmp_path, tokenized, extracted, random_target_dir):
    class Crash(Exception):
        pass

    def crash_after_first_shard(info):
        if info["shards_done"] == 1:
            raise Crash

    shards = tmp_path / "shards"
    with pytest.raises(Crash):
        _extract(tokenized, shards, random_target_dir, progress=crash_after_first_shard)
    assert [r.shard_index for r in read_manifest(shards)] == [0]
    resumed = _extract(tokenized, shards, random_target_dir, cfg=CFG.model_copy(update={"batch_size": 1}))
    assert (resumed.shards_skipped, resumed.shards_written) == (1, resumed.shards_total - 1)
    uninterrupted = read_manifest(extracted[0])
    assert [(r.sample_start, r.sample_end, r.num_tokens) for r in read_manifest(shards)] == [
        (r.sample_start, r.sample_end, r.num_tokens) for r in uninterrupted
    ]
    for row in uninterrupted:
        a, b = load_shard(shards / row.file)[0], load_shard(extracted[0] / row.file)[0]
        torch.testing.assert_close(a["aux_hidden_states"], b["aux_hidden_states"], atol=1e-4, rtol=1e-4)


def test_stray_temporary_is_removed(finished, tokenized, random_target_dir):
    stray = finished / ".shard-00001.safetensors.tmp-4242"
    stray.write_bytes(b"half a shard")
    summary = _extract(tokenized, finished, random_target_dir)
    assert summary.strays_removed == 1 and summary.shards_written == 0
    assert not stray.exists()


def test_shard_file_without_manifest_row_is_reextracted(finished, tokenized, random_target_dir):
    rows = read_manifest(finished)
    original = {k: v.clone() for k, v in load_shard(finished / rows[-1].file)[0].items()}  # the file is mmapped
    write_manifest(finished, rows[:-1])  # crash between rename and manifest write
    (finished / rows[-1].file).write_bytes(b"not what the manifest would say")
    summary = _extract(tokenized, finished, random_target_dir)
    assert (summary.shards_written, summary.unlisted_rewritten) == (1, 1)
    rewritten = read_manifest(finished)
    assert rewritten[:-1] == rows[:-1]
    assert checksum_file(finished / rows[-1].file) == rewritten[-1].checksum
    tensors, _ = load_shard(finished / rows[-1].file)
    for name, value in original.items():  # the same numbers (not bytes: metadata key order varies)
        assert torch.equal(tensors[name], value), name


def test_resume_with_other_config_is_refused(finished, tokenized, random_target_dir):
    with pytest.raises(
        ExtractConfigMismatchError,
        match=r"extract.json: the shards there were extracted with "
        r"other parameters: dtype='float32' there, 'bfloat16' now.*use a new shards_dir",
    ):
        _extract(tokenized, finished, random_target_dir, cfg=CFG.model_copy(update={"dtype": "bfloat16"}))
    with pytest.raises(ExtractConfigMismatchError, match=r"aux_layer_ids=\[2, 4, 5\] there, \[1, 4, 6\] now"):
        extract(tokenized, finished, random_target_dir, CFG, aux_layer_ids=[1, 4, 6])


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_a_shard_that_no_longer_matches_its_row_is_quarantined_and_extracted_again(
    finished, tokenized, random_target_dir, damage, capsys
):
    shard = finished / shard_filename(0)
    original = shard.read_bytes()
    if damage == "delete":
        shard.unlink()
    else:
        shard.write_bytes(original[:-100])
    capsys.readouterr()
    summary = _extract(tokenized, finished, random_target_dir)
    assert summary.shards_written == 1 and shard.read_bytes() == original
    [note] = (finished / QUARANTINE_DIR).glob("shard-00000.safetensors.*.reason.txt")
    now = "missing" if damage == "delete" else f"{len(original) - 100} bytes"
    reason = f"shard-00000.safetensors: listed in the manifest ({len(original)} bytes) but {now} in storage"
    assert note.read_text().startswith(reason)
    assert f"quarantined (extracted again): {reason}" in capsys.readouterr().out


def test_second_concurrent_run_is_refused(finished, tokenized, random_target_dir):
    with open(finished / ".extract.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running extraction would
        with pytest.raises(RuntimeError, match=r"another extraction holds .extract.lock; wait for it to finish"):
            _extract(tokenized, finished, random_target_dir)


def test_progress_reports_each_shard(finished, tokenized, samples, random_target_dir):
    rows = read_manifest(finished)
    write_manifest(finished, rows[:-2])
    seen = []
    summary = _extract(tokenized, finished, random_target_dir, progress=seen.append)
    assert len(seen) == 3  # once at start, then after each of the two shards extracted
    assert (seen[0]["shards_done"], seen[0]["samples_done"]) == (len(rows) - 2, rows[-2].sample_start)
    assert {
        k: seen[-1][k] for k in ("shards_done", "shards_total", "samples_done", "samples_total", "tokens_done")
    } == {
        "shards_done": summary.shards_total,
        "shards_total": summary.shards_total,
        "samples_done": len(samples),
        "samples_total": len(samples),
        "tokens_done": sum(map(len, samples)),
    }


def test_width_check_lists_known_causes():
    check_aux_width(192, num_aux=3, hidden_size=64, source="shard 00000 sample 0")
    with pytest.raises(AuxWidthError) as e:
        check_aux_width(64, num_aux=3, hidden_size=64, source="shard 00000 sample 0")
    msg = str(e.value)
    assert msg.startswith("shard 00000 sample 0: aux_hidden_states width 64, expected 192 (3 layers x 64); it is H")
    for cause in ("capture is not enabled", "EAGLE instead of EAGLE3", "wrapper model"):
        assert cause in msg
