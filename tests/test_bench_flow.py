"""The benchmark flow against a real Prefect server: a tau below the floor fails the run with a diagnosis."""

from __future__ import annotations

import json

import pytest
from draft_fixtures import train_and_export, write_shards

from eyas.bench.reference import load_target_float64
from eyas.config import RunConfig
from eyas.target import target_fingerprint


@pytest.fixture
def low_tau_run(random_target_dir, tmp_path):
    """A run directory with verified-style shards and an untrained (random) draft exported."""
    model = load_target_float64(random_target_dir)
    fingerprint = target_fingerprint(random_target_dir)
    write_shards(tmp_path / "run" / "shards", model, fingerprint)
    export = train_and_export(tmp_path / "ckpt", model, tmp_path / "run" / "shards", fingerprint, num_steps=0)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": str(i), "conversations": [{"role": "user", "content": f"import os{i}\n"}]} for i in range(2)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = RunConfig(
        workdir=str(tmp_path / "run"),
        target={"model_path": str(random_target_dir)},
        dataset={"prompts_path": str(prompts)},
        bench={"prompts_path": str(prompts), "num_steps": 2, "max_new_tokens": 6, "min_tau": 2.0},
    )
    return config, export


def test_tau_below_the_floor_fails_the_flow_with_a_diagnosis(prefect_server, low_tau_run):
    from flows.bench import bench_flow

    config, export = low_tau_run
    state = bench_flow(config, str(export), return_state=True)
    assert state.is_failed()
    assert "< bench.min_tau 2.0 (reference engine; n-gram" in state.message
    assert "| teacher_forced_accuracy | FAILED |" in state.message
    assert "every file check passed but the draft is weak" in state.message
    bench_dir = config.paths.bench_dir
    result = json.loads((bench_dir / "benchmark.json").read_text())
    assert result["tau_mean"] < 2.0 and result["lossless"] is True and "tau_ngram" in result
    diagnosis = json.loads((bench_dir / "diagnosis.json").read_text())
    assert {c["name"]: c["passed"] for c in diagnosis["checks"]}["teacher_forced_accuracy"] is False
    assert (bench_dir / "acceptance.png").stat().st_size > 1000
