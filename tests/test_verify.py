"""Shard verification: good shards pass; each kind of damage is flagged with its reason."""

from __future__ import annotations

import math
import random
import shutil
from dataclasses import replace

import pyarrow.parquet as pq
import pytest
from faults import KINDS, apply_fault
from run_fixtures import extract, write_tokenized

from eyas.config import ExtractConfig
from eyas.facts import facts_for
from eyas.shards.format import load_shard, shard_filename, write_shard
from eyas.shards.manifest import read_manifest, write_manifest
from eyas.verify import workers
from eyas.verify.report import write_verify_report
from eyas.verify.shard_set import (
    ShardVerificationError,
    expected_shard_meta,
    quarantine_bad_shards,
    raise_if_bad,
    verify_shards,
)

CFG = ExtractConfig(shard_bytes=1 << 16, batch_size=4)  # ~63 tokens of H=64 float32 per shard


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, random_target_dir):
    """(tokenized path, shards dir, expected metadata) of one small extraction, shared read-only."""
    root = tmp_path_factory.mktemp("verify")
    rng = random.Random(1)
    samples = [[rng.randrange(1, 2048) for _ in range(rng.randint(4, 20))] for _ in range(10)]
    tokenized = write_tokenized(root / "tokenized.parquet", samples)
    extract(tokenized, root / "shards", random_target_dir, CFG)
    facts = facts_for(target_path=random_target_dir, tokenized_path=tokenized, shards_dir=root / "shards")
    expected = expected_shard_meta(facts, "float32")
    return tokenized, root / "shards", expected


@pytest.fixture
def shards(tmp_path, extracted):
    """A private copy of the extracted shards, free to damage."""
    shutil.copytree(extracted[1], tmp_path / "shards")
    return tmp_path / "shards"


def _verify(shards_dir, extracted, mode="full", expected=None, **kwargs):
    return verify_shards(
        shards_dir=shards_dir, tokenized_path=extracted[0], expected=expected or extracted[2], mode=mode, **kwargs
    )


def _bad_reasons(report):
    return {r.file: r.reason for r in report.rows if r.status == "bad"}


def _rewrite(shards_dir, index, mutate):
    """Rewrite shard `index` through write_shard (so its checksum and manifest row are right) after
    `mutate(tensors, meta) -> (tensors, meta)`: damage that extraction itself could have produced."""
    tensors, meta = load_shard(shards_dir / shard_filename(index))
    tensors, meta = mutate({k: v.clone() for k, v in tensors.items()}, meta)
    row = write_shard(shards_dir, tensors, meta)
    write_manifest(shards_dir, [row if r.shard_index == index else r for r in read_manifest(shards_dir)])


def test_good_shards_pass_both_modes(shards, extracted):
    for mode in ("cheap", "full"):
        report = _verify(shards, extracted, mode)
        assert report.ok, _bad_reasons(report) or report.problems
        assert len(report.rows) == len(read_manifest(shards)) > 1
        summary = report.summary()
        assert (summary["shards"], summary["ok"], summary["bad"]) == (len(report.rows), len(report.rows), 0)
        assert summary["tokens"] == sum(r.num_tokens for r in read_manifest(shards))
    assert report.rows[0].checks_passed == [
        "listed",
        "header",
        "identity",
        "size",
        "metadata",
        "layout",
        "offsets",
        "checksum",
        "finite",
        "encoding",
        "dataset",
    ]
    raise_if_bad(report)


def test_flipped_byte_fails_checksum_in_full_mode_only(shards, extracted):
    path = shards / shard_filename(1)
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01
    path.write_bytes(bytes(data))
    assert _verify(shards, extracted, "cheap").ok  # cheap mode reads no tensor bytes
    reasons = _bad_reasons(_verify(shards, extracted, "full"))
    assert list(reasons) == ["shard-00001.safetensors"]
    assert reasons["shard-00001.safetensors"].startswith("shard-00001.safetensors: checksum mismatch: xxh3-128:")
    assert "the manifest says" in reasons["shard-00001.safetensors"]


def test_nan_values_are_flagged(shards, extracted):
    def put_nan(tensors, meta):
        tensors["aux_hidden_states"][3, 5] = math.nan
        return tensors, meta

    _rewrite(shards, 0, put_nan)
    reasons = _bad_reasons(_verify(shards, extracted))
    assert reasons["shard-00000.safetensors"].startswith(
        "shard-00000.safetensors: aux_hidden_states has non-finite values (first at token 3, sample 0)"
    )


def test_inf_values_are_flagged(shards, extracted):
    def put_inf(tensors, meta):
        tensors["last_hidden_states"][-1, 0] = -math.inf
        return tensors, meta

    _rewrite(shards, 1, put_inf)
    row = read_manifest(shards)[1]
    reason = _bad_reasons(_verify(shards, extracted))["shard-00001.safetensors"]
    assert reason.startswith(
        f"shard-00001.safetensors: last_hidden_states has non-finite values (first at token "
        f"{row.num_tokens - 1}, sample {row.sample_end - 1}); the target produced NaN/inf"
    )


def test_non_finite_value_is_found_with_chunks_smaller_than_a_token(shards, extracted):
    def put_nan(tensors, meta):
        tensors["aux_hidden_states"][7, 150] = math.nan
        return tensors, meta

    _rewrite(shards, 0, put_nan)
    report = _verify(shards, extracted, chunk_bytes=4096, num_workers=1)
    assert report.bad_files == ["shard-00000.safetensors"]
    assert "aux_hidden_states has non-finite values (first at token 7, sample 0)" in report.rows[0].reason


def test_wrong_dtype_is_flagged(shards, extracted):
    def half(tensors, meta):
        tensors["aux_hidden_states"] = tensors["aux_hidden_states"].half()
        return tensors, meta

    _rewrite(shards, 0, half)
    reason = _bad_reasons(_verify(shards, extracted, "cheap"))["shard-00000.safetensors"]
    assert reason == (
        "shard-00000.safetensors: aux_hidden_states dtype F16, expected F32 (encoding float32/last_hidden, dtype float32); "
        "quarantine the shard (eyas.shards.shard_set.quarantine_shards) and re-run extraction"
    )


def test_swapped_shards_are_flagged(shards, extracted):
    a, b = shards / shard_filename(0), shards / shard_filename(1)
    a.rename(shards / "tmp")
    b.rename(a)
    (shards / "tmp").rename(b)
    rows = read_manifest(shards)
    reasons = _bad_reasons(_verify(shards, extracted, "cheap"))
    assert list(reasons) == [a.name, b.name]
    assert reasons[a.name].startswith(
        f"shard-00000.safetensors: the file holds shard 1 (samples {rows[1].sample_start}..{rows[1].sample_end}), "
        f"but its name and the manifest say shard 0 (samples 0..{rows[0].sample_end}): files swapped or renamed"
    )


def test_offsets_that_do_not_add_up_are_flagged(shards, extracted):
    def move_boundary(tensors, meta):
        tensors["sample_offsets"][1] += 1
        return tensors, meta

    _rewrite(shards, 0, move_boundary)
    lengths = [len(s) for s in pq.read_table(extracted[0]).column("input_ids").to_pylist()]
    reason = _bad_reasons(_verify(shards, extracted, "cheap"))["shard-00000.safetensors"]
    assert reason.startswith(
        f"shard-00000.safetensors: sample_offsets do not add up: sample 0 spans {lengths[0] + 1} tokens, "
        f"the tokenized dataset has {lengths[0]}"
    )


def test_offsets_beyond_the_token_count_are_flagged(shards, extracted):
    def overrun(tensors, meta):
        tensors["sample_offsets"][-1] += 3
        return tensors, meta

    _rewrite(shards, 0, overrun)
    reason = _bad_reasons(_verify(shards, extracted, "cheap"))["shard-00000.safetensors"]
    assert "do not add up: expected strictly increasing from 0 to the shard's" in reason


def test_loss_mask_differing_from_dataset_is_flagged(shards, extracted):
    def flip_mask(tensors, meta):
        tensors["loss_mask"][0] = 1 - tensors["loss_mask"][0]
        return tensors, meta

    _rewrite(shards, 1, flip_mask)
    reason = _bad_reasons(_verify(shards, extracted))["shard-00001.safetensors"]
    assert "loss_mask differs from the tokenized dataset at token 0" in reason


def test_wrong_width_is_flagged(shards, extracted):
    def one_layer(tensors, meta):
        tensors["aux_hidden_states"] = tensors["aux_hidden_states"][:, :64]
        return tensors, meta

    _rewrite(shards, 0, one_layer)
    reason = _bad_reasons(_verify(shards, extracted, "cheap"))["shard-00000.safetensors"]
    assert "aux_hidden_states width 64, expected 192 (3 layers x 64); the backend did not return" in reason


def test_wrong_layer_ids_in_metadata_are_flagged(shards, extracted):
    _rewrite(shards, 1, lambda t, m: (t, replace(m, aux_layer_ids=(1, 4, 5))))
    reason = _bad_reasons(_verify(shards, extracted, "cheap"))["shard-00001.safetensors"]
    assert "metadata disagrees with the run config: aux_layer_ids [1, 4, 5], expected [2, 4, 5]" in reason


def test_other_target_is_flagged(shards, extracted):
    expected = replace(extracted[2], target_fingerprint="0123456789abcdef")
    reasons = _bad_reasons(_verify(shards, extracted, "cheap", expected=expected))
    assert len(reasons) == len(read_manifest(shards))
    assert "target_fingerprint '" in reasons["shard-00000.safetensors"]
    assert "expected '0123456789abcdef'" in reasons["shard-00000.safetensors"]


def test_quarantine_refuses_when_every_shard_disagrees_with_the_config(shards, extracted):
    expected = replace(extracted[2], aux_layer_ids=(1, 2, 3))
    report = _verify(shards, extracted, "cheap", expected=expected)
    with pytest.raises(ShardVerificationError, match=r"metadata disagree with the run config .* not quarantining"):
        quarantine_bad_shards(shards, report)
    assert len(read_manifest(shards)) == len(report.rows)


def test_missing_shard_file_is_flagged(shards, extracted):
    (shards / shard_filename(1)).unlink()
    reasons = _bad_reasons(_verify(shards, extracted, "cheap"))
    assert reasons == {
        "shard-00001.safetensors": "shard-00001.safetensors: listed in the manifest but missing on "
        "disk; quarantine the shard (eyas.shards.shard_set.quarantine_shards) and re-run extraction"
    }


def test_extra_shard_file_is_flagged(shards, extracted):
    shutil.copy(shards / shard_filename(0), shards / shard_filename(99))
    report = _verify(shards, extracted, "cheap")
    reasons = _bad_reasons(report)
    assert list(reasons) == ["shard-00099.safetensors"]
    assert reasons["shard-00099.safetensors"].startswith("shard-00099.safetensors: not in the manifest")
    assert [r.shard for r in report.rows if r.status == "bad"] == [99]


def test_truncated_file_is_flagged(shards, extracted):
    path = shards / shard_filename(0)
    path.write_bytes(path.read_bytes()[:-100])
    reason = _bad_reasons(_verify(shards, extracted, "cheap"))["shard-00000.safetensors"]
    assert "bytes, the manifest says" in reason and "(truncated or overwritten)" in reason


@pytest.mark.skipif(workers.usable_cores() < 2 or not workers.can_fork(), reason="needs 2 cores and fork")
def test_cheap_mode_on_processes_reports_what_one_thread_reports(shards, extracted, monkeypatch):
    path = shards / shard_filename(0)
    path.write_bytes(path.read_bytes()[:-100])
    one_thread = _verify(shards, extracted, "cheap", num_workers=1)
    monkeypatch.setattr(workers, "PROCESS_MIN_S", 0.0)  # few shards: processes only when told there is work
    monkeypatch.setattr(workers, "PROCESS_GAIN", 0.0)  # and kept whatever their rate
    monkeypatch.setattr(workers, "FIRST_BATCH", 1)
    on_processes = _verify(shards, extracted, "cheap", num_workers=2)
    assert (one_thread.workers, on_processes.workers) == ("one thread", "2 processes")
    strip = [(r.file, r.status, r.checks_passed, r.reason, r.num_bytes) for r in one_thread.rows]
    assert [(r.file, r.status, r.checks_passed, r.reason, r.num_bytes) for r in on_processes.rows] == strip
    assert not one_thread.ok and one_thread.problems == on_processes.problems


def test_input_ids_differing_from_dataset_are_flagged(shards, extracted):
    def shift_token(tensors, meta):
        tensors["input_ids"][2] += 1
        return tensors, meta

    _rewrite(shards, 0, shift_token)
    assert _verify(shards, extracted, "cheap").ok  # cheap mode does not read tokens
    reason = _bad_reasons(_verify(shards, extracted))["shard-00000.safetensors"]
    assert "input_ids differs from the tokenized dataset at token 2 (sample 0)" in reason


def test_samples_in_no_shard_are_a_problem(shards, extracted):
    rows = read_manifest(shards)
    (shards / rows[-1].file).unlink()
    write_manifest(shards, rows[:-1])
    report = _verify(shards, extracted, "cheap")
    assert not report.ok and all(r.status == "ok" for r in report.rows)
    assert report.problems == [
        f"{shards}: samples {rows[-1].sample_start}..9 (of 10) are in no shard of the "
        f"manifest; re-run extraction to fill them"
    ]


def test_raise_if_bad_lists_every_bad_shard(shards, extracted):
    (shards / shard_filename(0)).unlink()
    shutil.copy(shards / shard_filename(1), shards / shard_filename(99))
    report = _verify(shards, extracted, "cheap")
    with pytest.raises(ShardVerificationError) as e:
        raise_if_bad(report)
    msg = str(e.value)
    assert msg.startswith(
        f"shard verification (cheap) failed: 2 of {len(report.rows)} shards bad, 0 directory problems"
    )
    assert "shard-00000.safetensors: listed in the manifest but missing" in msg
    assert "shard-00099.safetensors: not in the manifest" in msg
    assert e.value.report.bad_files == ["shard-00000.safetensors", "shard-00099.safetensors"]


def test_report_is_written_as_parquet(shards, extracted, tmp_path):
    (shards / shard_filename(0)).unlink()
    report = _verify(shards, extracted, "cheap")
    path = write_verify_report(report, tmp_path / "verify" / "report.parquet")
    table = pq.read_table(path)
    assert table.column_names == [
        "shard",
        "file",
        "status",
        "checks_passed",
        "reason",
        "num_tokens",
        "num_bytes",
        "seconds",
    ]
    rows = table.to_pylist()
    assert [(r["shard"], r["status"]) for r in rows][:2] == [(0, "bad"), (1, "ok")]
    assert rows[1]["checks_passed"] == ["listed", "header", "identity", "size", "metadata", "layout", "offsets"]
    assert table.schema.metadata[b"eyas.verify.mode"] == b"cheap"


def test_unparsable_header_is_flagged(shards, extracted):
    path = shards / shard_filename(0)
    data = bytearray(path.read_bytes())
    data[8:12] = b"!!!!"  # the JSON header starts at byte 8; the size stays what the manifest says
    path.write_bytes(bytes(data))
    reason = _bad_reasons(_verify(shards, extracted, "cheap"))["shard-00000.safetensors"]
    assert reason.startswith("shard-00000.safetensors: safetensors header does not parse (")


def test_quarantined_shards_are_reextracted_and_pass(shards, extracted, random_target_dir):
    def put_nan(tensors, meta):
        tensors["last_hidden_states"][0, 0] = math.nan
        return tensors, meta

    _rewrite(shards, 1, put_nan)
    report = _verify(shards, extracted)
    assert report.bad_files == ["shard-00001.safetensors"]
    notes = quarantine_bad_shards(shards, report)
    assert [n.removeprefix("quarantine/").split(".safetensors")[0] for n in notes] == ["shard-00001"]
    assert "last_hidden_states has non-finite values (first at token 0" in (shards / notes[0]).read_text()
    summary = extract(extracted[0], shards, random_target_dir, CFG)
    assert summary.shards_written == 1
    assert _verify(shards, extracted).ok


class CountingS3:
    """The S3 storage, counting the two ways verification reads a remote shard."""

    def __init__(self, store):
        self.store, self.ranges, self.downloads = store, 0, 0

    def __getattr__(self, name):
        return getattr(self.store, name)

    def get_range(self, name, start, end):
        self.ranges += 1
        return self.store.get_range(name, start, end)

    def download_to(self, name, path):
        self.downloads += 1
        return self.store.download_to(name, path)


@pytest.mark.parametrize("kind", [None, *KINDS, "nan"])
def test_shards_on_s3_verify_as_their_local_copy_does_without_one(shards, extracted, kind, s3_bucket, s3_endpoint):
    """Verification reads S3 directly (no local copy): cheap mode by range requests for the headers and offsets,
    full mode streaming each shard through a temporary file; each damage gets the local copy's verdict."""
    from eyas.storage.s3 import S3Storage

    if kind is not None:
        apply_fault(shards, kind)
    store = CountingS3(S3Storage(f"s3://{s3_bucket}/{kind}", endpoint_url=s3_endpoint))
    for path in sorted(p for p in shards.rglob("*") if p.is_file()):
        store.put_bytes(str(path.relative_to(shards)), path.read_bytes())
    for mode in ("cheap", "full"):
        local, remote = _verify(shards, extracted, mode), _verify(store, extracted, mode)
        assert _bad_reasons(remote) == _bad_reasons(local), mode
        assert [(r.file, r.status, r.checks_passed, r.num_bytes) for r in remote.rows] == [
            (r.file, r.status, r.checks_passed, r.num_bytes) for r in local.rows
        ]
        assert remote.problems == [p.replace(str(shards), store.url) for p in local.problems]
        if mode == "cheap":
            assert store.downloads == 0 and store.ranges >= len(remote.rows) - (kind in ("delete",))
    assert store.downloads == len([r for r in remote.rows if r.file in store.list()])
    assert (kind is None) == remote.ok
