"""extract.retention = N shards (eyas.shards.retention, eyas.train.shard_use): each shard's last use from the
trainer's own order, releases bounded by a real trainer's newest complete checkpoint (which a resume then finishes
without the released shards, to the same weights), the producer's window on a real streamed extraction, and the
config-time check."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, replace

import pytest
from pydantic import ValidationError
from run_fixtures import REPO, run_trainer, tiny_job, write_tiny_run, write_tokenized
from safetensors.torch import load_file

from eyas.config import ExtractConfig, PlannedShard, StreamSource, load_run_config
from eyas.extract.plan import check_manifest_against_plan, describe_extraction
from eyas.extract.streamed import run_streamed_extraction
from eyas.facts import facts_for
from eyas.shards.format import ShardPlan, load_shard, shard_filename, write_shard
from eyas.shards.manifest import read_manifest, record_row
from eyas.shards.retention import (
    RUN_OVER,
    RetentionWindow,
    release_shards,
    released_name,
    released_shards,
    required_window,
)
from eyas.shards.shard_set import RUN_META_NAME, ExtractRunMeta
from eyas.shards.synthetic import SYNTHETIC_DATASET_HASH, SyntheticSpec
from eyas.storage import open_storage
from eyas.target import target_fingerprint
from eyas.train.checkpoint import CHECKPOINTS_DIR, FINAL_FILE, step_dir_name
from eyas.train.data import TrainSplit, batch_at, total_steps
from eyas.train.shard_use import shard_use, trained_through
from eyas.train.stream_order import plan_windows
from eyas.verify.arrivals import ArrivalVerifier
from eyas.verify.checks import ExpectedShardMeta

TRAIN = dict(num_processes=1, num_epochs=1, global_batch_size=4, eval_fraction=0.05, save_every_steps=2,
             num_checkpoints_kept=3, shuffle_window_shards=1)  # fmt: skip


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A finished synthetic run of 6 shards, its tokenized table, what its shards' metadata must say, its plan
    and its extract.json."""
    root = tmp_path_factory.mktemp("retention-source")
    run = write_tiny_run(root, num_samples=24, per_shard=4)
    samples = run["samples"]
    tokenized = write_tokenized(root / "tokenized.parquet", [s["input_ids"].tolist() for s in samples],
                                masks=[s["loss_mask"].tolist() for s in samples],
                                dataset_hash=SYNTHETIC_DATASET_HASH)  # fmt: skip
    spec = SyntheticSpec()
    expected = ExpectedShardMeta(target_fingerprint=target_fingerprint(run["target"]),
                                 aux_layer_ids=spec.aux_layer_ids, hidden_size=spec.hidden, num_aux=spec.num_aux,
                                 dtype="float32", dataset_hash=SYNTHETIC_DATASET_HASH)  # fmt: skip
    rows = read_manifest(run["shards"])
    _, meta = load_shard(run["shards"] / rows[0].file)
    run_meta = ExtractRunMeta(format_version=meta.format_version, target_fingerprint=meta.target_fingerprint,
                              aux_layer_ids=list(meta.aux_layer_ids), layer_id_convention=meta.layer_id_convention,
                              hidden_size=meta.hidden_size, num_aux=meta.num_aux, dtype=meta.dtype,
                              target_dtype="float32", backend=meta.backend, dataset_hash=meta.dataset_hash,
                              shard_bytes=max(r.num_bytes for r in rows), num_shards=len(rows),
                              aux_dtype=meta.aux_dtype, teacher=meta.teacher, teacher_topk=meta.teacher_topk)  # fmt: skip
    plan = [ShardPlan(r.shard_index, r.sample_start, r.sample_end, r.num_tokens) for r in rows]
    return {"run": run, "tokenized": tokenized, "expected": expected, "plan": plan, "run_meta": run_meta}


def verified_store(source, where):
    """A store holding every shard of `source`, committed as extraction commits them and verified on arrival."""
    store = open_storage(where)
    store.put_bytes(RUN_META_NAME, json.dumps(asdict(source["run_meta"])).encode())
    for p in source["plan"]:
        tensors, meta = load_shard(source["run"]["shards"] / shard_filename(p.index))
        record_row(store, write_shard(store, tensors, meta))
    verifier = ArrivalVerifier(store, tokenized_path=source["tokenized"], expected=source["expected"], mode="full",
                               log=lambda _: None)  # fmt: skip
    verifier.poll()
    assert verifier.verified == {p.index for p in source["plan"]}
    return store


def stream_job(source, store_dir, out):
    plan = [PlannedShard(sample_start=p.sample_start, sample_end=p.sample_end, num_tokens=p.num_tokens)
            for p in source["plan"]]  # fmt: skip
    job = tiny_job(source["run"], out, **TRAIN)
    return job.model_copy(update={"shards_dir": str(store_dir), "stream": StreamSource(verify_mode="full", plan=plan)})


def windowed_run(tmp_path, *, num_samples: int):
    """A tokenized table of `num_samples` random samples (4 to 16 tokens) and the tiny preset's config with 64 KiB
    shards, a window of 4 shards and one epoch (not validated: the tests build their own windows)."""
    samples = [[random.Random(k).randrange(1, 2048) for _ in range(4 + k % 13)] for k in range(num_samples)]
    tokenized = write_tokenized(tmp_path / "tokenized.parquet", samples)
    base = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    train = base.train.model_copy(update={"global_batch_size": 4, "shuffle_window_shards": 2, "num_epochs": 1})
    extract = base.extract.model_copy(update={"shard_bytes": 1 << 16, "batch_size": 8, "retention": 4})
    return tokenized, base.model_copy(update={"extract": extract, "train": train})


def test_a_shards_last_use_is_the_last_step_whose_batch_reads_it(source):
    plan, train = source["plan"], tiny_job(source["run"], "unused", **{**TRAIN, "num_epochs": 2}).train
    use = shard_use(plan, train)
    split = TrainSplit.of(24, train.eval_fraction)
    windows, last = plan_windows(plan, train), {}
    shard_of = {i: p.index for p in plan for i in range(p.sample_start, p.sample_end)}
    for step in range(1, total_steps(24, train) + 1):
        _, positions = batch_at((step - 1) * train.global_batch_size, len(split.train_ids),
                                train.global_batch_size, train.seed, windows)  # fmt: skip
        for pos in positions:
            last[shard_of[split.train_ids[pos]]] = step
    for shard in {shard_of[i] for i in split.eval_ids}:
        last[shard] = total_steps(24, train) + 1  # every evaluation reads it, the last at the run's end
    assert use.last_step == last
    assert all(use.first_step[k] <= use.last_step[k] for k in use.first_step)
    assert sorted(use.order) == [p.index for p in plan]


def test_a_window_too_small_for_the_stretch_between_checkpoints_is_refused(source, tmp_path):
    use = shard_use(source["plan"], tiny_job(source["run"], tmp_path, **TRAIN).train)
    need = required_window(use)
    assert 1 < need <= len(source["plan"])
    with pytest.raises(ValueError) as err:
        RetentionWindow(open_storage(tmp_path / "s"), use, size=need - 1, mode="full", trained_through=lambda: 0)
    assert str(err.value) == (
        f"extract.retention={need - 1} shards: between two checkpoints the trainer reads {need} shards that must be "
        f"in storage together (train.save_every_steps=2); the producer would wait for a release the trainer cannot "
        f"reach; set extract.retention to at least {need}, lower train.save_every_steps, or keep every shard "
        f"(extract.retention='keep')"
    )


def test_releases_follow_the_newest_checkpoint_and_a_resume_finishes_without_them(source, tmp_path):
    store = verified_store(source, tmp_path / "store")
    job = stream_job(source, tmp_path / "store", tmp_path / "train")
    (tmp_path / "job.json").write_text(job.model_dump_json())
    run_trainer(tmp_path / "job.json", None)
    checkpoints = tmp_path / "train" / CHECKPOINTS_DIR
    last = total_steps(24, job.train)
    assert last == 5
    uninterrupted = load_file(checkpoints / step_dir_name(last) / "model.safetensors")
    for step in (4, 5):  # the trainer as a crash after step 2's checkpoint leaves it
        shutil.rmtree(checkpoints / step_dir_name(step))
    (tmp_path / "train" / FINAL_FILE).unlink()
    use = shard_use(source["plan"], job.train)
    assert trained_through(tmp_path / "train") == 2

    released = release_shards(store, use, trained_through=2, mode="full", log=lambda _: None)
    assert released == sorted(k for k, s in use.last_step.items() if s <= 2) and 0 < len(released) < 6
    assert released_shards(store) == set(released)
    listing = store.list()
    assert not any(shard_filename(k) in listing for k in released)
    assert [r.shard_index for r in read_manifest(store)] == list(range(6))  # the rows stay
    record = json.loads(store.get_bytes(released_name(released[0])))
    assert (record["last_step"], record["trained_through"]) == (use.last_step[released[0]], 2)
    done, damaged = check_manifest_against_plan(store, source["plan"], listing)
    assert (done, damaged) == (set(range(6)), {})  # the producer extracts none of them again

    run_trainer(tmp_path / "job.json", None)  # resumes at step 2 and reads only shards still in storage
    resumed = load_file(checkpoints / step_dir_name(last) / "model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    assert all((resumed[k] == uninterrupted[k]).all() for k in resumed)
    assert trained_through(tmp_path / "train") == RUN_OVER
    rest = release_shards(store, use, trained_through=RUN_OVER, mode="full", log=lambda _: None)
    assert sorted(released + rest) == list(range(6))
    assert not any(name.startswith("shard-") for name in store.list())


def test_a_release_interrupted_before_the_deletion_is_finished_by_the_next(source, tmp_path):
    store = verified_store(source, tmp_path / "store")
    use = shard_use(source["plan"], tiny_job(source["run"], tmp_path, **TRAIN).train)
    row = read_manifest(store)[use.order[0]]
    record = {"row": asdict(row), "last_step": use.last_step[row.shard_index], "trained_through": 2}
    store.put_bytes(released_name(row.shard_index), json.dumps(record).encode())  # a crash came before the deletion
    assert row.file in store.list()
    assert release_shards(store, use, trained_through=0, mode="full", log=lambda _: None) == []
    assert row.file not in store.list()


def test_a_retention_window_needs_a_single_epoch_streamed_run():
    base = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    data = base.model_dump(mode="json")
    data["extract"]["retention"] = 4
    data["train"]["num_epochs"] = 1
    with pytest.raises(ValidationError) as err:  # an offline run extracts everything first: a window means nothing
        type(base).model_validate(data)
    assert (
        "extract.retention=4 shards bounds the shards a streamed run keeps in storage, and train.start='offline' "
        "extracts every shard before training reads any; set train.start to 'streaming', or extract.retention to "
        "'keep'"
    ) in str(err.value)
    data["train"]["start"] = "streaming"
    assert type(base).model_validate(data).extract.retention == 4
    data["train"]["num_epochs"] = 2
    with pytest.raises(ValidationError) as err:
        type(base).model_validate(data)
    assert (
        "extract.retention=4 shards releases each shard after its last use, and train.num_epochs=2 reads every "
        "shard again in each epoch; set train.num_epochs to 1, or extract.retention to 'keep'"
    ) in str(err.value)
    assert ExtractConfig().retention == "keep"
    with pytest.raises(ValidationError):
        ExtractConfig(retention=0)


def test_a_streamed_extraction_keeps_at_most_the_window_in_storage_and_resumes_past_released_shards(
    tmp_path, random_target_dir
):
    tokenized, config = windowed_run(tmp_path, num_samples=60)
    train = config.train
    facts = facts_for(target_path=random_target_dir, tokenized_path=tokenized, shards_dir=tmp_path / "shards")
    use = replace(shard_use(describe_extraction(config.extract, facts)[1], train), save_every_steps=1)
    size = required_window(use)
    assert size <= len(use.order) - 4  # the window holds back most of the run
    store = open_storage(tmp_path / "shards")
    window = RetentionWindow(store, use, size=size, mode=config.verify.mode, trained_through=lambda: RUN_OVER,
                             poll_s=0.02, log=lambda _: None)  # fmt: skip
    present = []
    report = lambda _: present.append(sum(n.startswith("shard-") for n in store.list()))  # noqa: E731
    summary = run_streamed_extraction(config, facts, shard_order=use.order, log=lambda _: None, poll_s=0.02,
                                      progress=report, retention=window)  # fmt: skip
    assert summary.shards_written == len(use.order) and max(present) <= size
    released = released_shards(store)
    assert len(released) >= len(use.order) - size
    assert [r.shard_index for r in read_manifest(store)] == sorted(use.order)  # every row stays
    again = run_streamed_extraction(config, facts, shard_order=use.order, log=lambda _: None, poll_s=0.02,
                                    retention=window)  # fmt: skip
    assert again.shards_written == 0 and released <= released_shards(store)


def test_the_pipelines_producer_builds_its_window_from_the_config_and_refuses_a_small_one_first(
    tmp_path, random_target_dir
):
    """tasks.stream.retention_window, which the producer task uses for the smoke's shards (before the gate) and for
    the run: None for 'keep'; a window follows the trainer's checkpoints in train_dir; one too small is refused."""
    from tasks.stream import retention_window

    samples = [[random.Random(k).randrange(1, 2048) for _ in range(4 + k % 13)] for k in range(60)]
    tokenized = write_tokenized(tmp_path / "tokenized.parquet", samples)
    base = load_run_config(REPO / "deployments" / "tiny-cpu.json").model_copy(update={"workdir": str(tmp_path / "w")})
    train = base.train.model_copy(update={"global_batch_size": 4, "num_epochs": 1, "save_every_steps": 1})
    facts = facts_for(target_path=random_target_dir, tokenized_path=tokenized, shards_dir=tmp_path / "shards")

    def with_retention(retention):
        extract = base.extract.model_copy(update={"shard_bytes": 1 << 16, "batch_size": 8, "retention": retention})
        return base.model_copy(update={"extract": extract, "train": train})

    assert retention_window(with_retention("keep"), facts) is None
    use = shard_use(describe_extraction(with_retention("keep").extract, facts)[1], train)
    need = required_window(use)
    window = retention_window(with_retention(need), facts)
    assert window.size == need and window.trained_through() == 0  # no checkpoint in train_dir yet
    assert need > 1
    with pytest.raises(ValueError, match=f"set extract.retention to at least {need}"):
        retention_window(with_retention(need - 1), facts)


def test_a_windowed_streamed_extraction_on_s3_ends_without_a_local_copy(tmp_path, random_target_dir, s3_bucket,
                                                                         s3_endpoint):  # fmt: skip
    """Over S3 a released shard's file is gone, so the end of a windowed extraction makes no local copy (one could not
    be whole): the run ends, every row stays, the local directory holds no shard."""
    tokenized, config = windowed_run(tmp_path, num_samples=40)
    train = config.train
    facts = facts_for(target_path=random_target_dir, tokenized_path=tokenized, shards_dir=tmp_path / "copy",
                      storage_url=f"s3://{s3_bucket}/shards", s3_endpoint_url=s3_endpoint)  # fmt: skip
    use = replace(shard_use(describe_extraction(config.extract, facts)[1], train), save_every_steps=1)
    store = facts.storage()
    window = RetentionWindow(store, use, size=required_window(use), mode=config.verify.mode,
                             trained_through=lambda: RUN_OVER, poll_s=0.02, log=lambda _: None)  # fmt: skip
    summary = run_streamed_extraction(config, facts, shard_order=use.order, log=lambda _: None, poll_s=0.02,
                                      retention=window)  # fmt: skip
    assert summary.shards_written == len(use.order) and summary.local_copy == {"fetched": 0, "kept": 0}
    assert released_shards(store) and [r.shard_index for r in read_manifest(store)] == sorted(use.order)
    assert not list((tmp_path / "copy").glob("shard-*"))
