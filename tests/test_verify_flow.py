"""The verify-shards flow heals: bad shards are quarantined with their reasons, re-extracted and verified
again; a shard still bad when the healing rounds run out fails the flow with every reason."""

from __future__ import annotations

import random

import pytest
from faults import KINDS, apply_fault
from run_fixtures import extract, write_tokenized

from eyas.config import load_run_config
from eyas.shards.manifest import read_manifest
from eyas.shards.shard_set import QUARANTINE_DIR

pytestmark = pytest.mark.usefixtures("flush_prefect_logs")


def extracted_run(tmp_path, tiny_target_dir, random_target_dir, *, seed: int, **verify):
    """A run config whose tokenized dataset (8 random samples) and shards exist."""
    base = load_run_config(tiny_target_dir.parents[1] / "deployments" / "tiny-cpu.json")
    config = base.model_copy(
        update={
            "workdir": str(tmp_path / "run"),
            "target": base.target.model_copy(update={"model_path": str(random_target_dir)}),
            "extract": base.extract.model_copy(update={"shard_bytes": 1 << 16, "batch_size": 4}),
            "verify": base.verify.model_copy(update=verify),
        }
    )
    rng = random.Random(seed)
    samples = [[rng.randrange(1, 2048) for _ in range(rng.randint(4, 20))] for _ in range(8)]
    config.paths.dataset_dir.mkdir(parents=True)
    write_tokenized(config.paths.tokenized, samples)
    extract(config.paths.tokenized, config.paths.shards_dir, random_target_dir, config.extract)
    return config


@pytest.fixture
def config(tmp_path, tiny_target_dir, random_target_dir):
    """A run whose tokenized dataset and shards exist; shard 1 holds a NaN (written with a valid checksum)."""
    config = extracted_run(tmp_path, tiny_target_dir, random_target_dir, seed=2)
    apply_fault(config.paths.shards_dir, "nan", at=1)
    return config


def test_flow_quarantines_reextracts_and_passes(prefect_server, config):
    from flows.verify import verify_flow

    summary = verify_flow(config)
    assert (summary["bad"], summary["heal_rounds"], summary["quarantined"]) == (0, 1, 1)
    assert summary["ok"] == summary["shards"] == len(read_manifest(config.paths.shards_dir))
    notes = sorted((config.paths.shards_dir / QUARANTINE_DIR).glob("*.reason.txt"))
    assert len(notes) == 1 and notes[0].name.startswith("shard-00001.safetensors.")
    assert notes[0].read_text().startswith("shard-00001.safetensors: aux_hidden_states has non-finite values")
    assert notes[0].with_name(notes[0].name.removesuffix(".reason.txt")).is_file()  # moved aside, not deleted


def test_flow_fails_with_every_reason_when_healing_runs_out(prefect_server, config):
    from flows.verify import verify_flow

    config = config.model_copy(update={"verify": config.verify.model_copy(update={"num_heal_rounds": 0})})
    state = verify_flow(config, return_state=True)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "shard verification (full) failed after 0 healing rounds: 1 of " in message
    assert "shard-00001.safetensors: aux_hidden_states has non-finite values (first at token 0" in message
    assert not (config.paths.shards_dir / QUARANTINE_DIR).exists()


@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_after_a_verified_run_is_not_hidden_by_the_cache(prefect_server, tmp_path, tiny_target_dir,
                                                                 random_target_dir, kind):  # fmt: skip
    """A clean run verifies (and is cached); the fault is applied; the next verify runs again (the cache key
    holds the shard files' evidence), detects it, quarantines, re-extracts, and the shards end byte for byte
    as they were."""
    from flows.verify import verify_flow

    config = extracted_run(tmp_path, tiny_target_dir, random_target_dir, seed=3, mode="full")
    shards = config.paths.shards_dir
    before = {p.name: p.read_bytes() for p in shards.glob("shard-*.safetensors")}
    assert verify_flow(config)["bad"] == 0
    assert verify_flow(config, return_state=True).result()["bad"] == 0  # unchanged files: reused
    apply_fault(shards, kind)
    summary = verify_flow(config)
    assert summary["quarantined"] >= 1 and summary["bad"] == 0, summary
    assert {p.name: p.read_bytes() for p in shards.glob("shard-*.safetensors")} == before
