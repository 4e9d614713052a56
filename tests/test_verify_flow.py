"""The verify-shards flow heals: bad shards are quarantined with their reasons, re-extracted and verified
again; a shard still bad when the healing rounds run out fails the flow with every reason."""

from __future__ import annotations

import math
import random

import pytest
from run_fixtures import extract, write_tokenized

from eyas.config import load_run_config
from eyas.shards.format import load_shard, shard_filename, write_shard
from eyas.shards.manifest import read_manifest, write_manifest
from eyas.shards.shard_set import QUARANTINE_DIR

pytestmark = pytest.mark.usefixtures("flush_prefect_logs")


@pytest.fixture
def config(tmp_path, tiny_target_dir, random_target_dir):
    """A run whose tokenized dataset and shards exist; shard 1 holds a NaN (written with a valid checksum)."""
    base = load_run_config(tiny_target_dir.parents[1] / "deployments" / "tiny-cpu.json")
    config = base.model_copy(
        update={
            "workdir": str(tmp_path / "run"),
            "target": base.target.model_copy(update={"model_path": str(random_target_dir)}),
            "extract": base.extract.model_copy(update={"shard_bytes": 1 << 16, "batch_size": 4}),
        }
    )
    rng = random.Random(2)
    samples = [[rng.randrange(1, 2048) for _ in range(rng.randint(4, 20))] for _ in range(8)]
    config.paths.dataset_dir.mkdir(parents=True)
    write_tokenized(config.paths.tokenized, samples)
    shards = config.paths.shards_dir
    extract(config.paths.tokenized, shards, random_target_dir, config.extract)
    tensors, meta = load_shard(shards / shard_filename(1))
    tensors = {k: v.clone() for k, v in tensors.items()}
    tensors["aux_hidden_states"][0, 0] = math.nan
    row = write_shard(shards, tensors, meta)
    write_manifest(shards, [row if r.shard_index == 1 else r for r in read_manifest(shards)])
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
