"""Files eyas writes are byte-deterministic for the same inputs: the same training job run twice, each in a
fresh process with another hash seed, writes the same checkpoint bytes, and the same checkpoint exported
twice (to every format) writes the same export bytes. What records time (the metric stream's elapsed
seconds) is the one difference, and it is named here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_fixtures import REPO, tiny_job, write_tiny_run

TIMING_FIELDS = {"elapsed_s", "tokens_per_s", "samples_per_s", "seconds", "step_s"}
TIMING_FIELDS |= {"data_wait_s", "data_stall_fraction"}  # the input pipeline's wait per step


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def without_timings(text: str) -> list:
    """JSON (or JSON lines) with the timing fields removed, to compare what is not a clock reading."""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()] if "\n{" in text else [json.loads(text)]
    return [{k: v for k, v in row.items() if k not in TIMING_FIELDS} for row in rows]


def fresh(args: list[str], seed: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": str(seed)}
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def two_trainings(tmp_path_factory):
    root = tmp_path_factory.mktemp("determinism")
    run = write_tiny_run(root / "run", num_samples=16)
    outs = []
    for seed in (1, 2):
        out = root / f"train-{seed}"
        job = root / f"job-{seed}.json"
        job.write_text(tiny_job(run, out, num_processes=1, num_epochs=2).model_dump_json())
        fresh(["-m", "eyas.train", "--config", str(job)], seed)
        outs.append(out)
    return outs


def test_the_same_training_writes_the_same_checkpoint_bytes(two_trainings):
    first, second = (tree_bytes(out / "checkpoints") for out in two_trainings)
    assert first.keys() == second.keys() and any(k.endswith("model.safetensors") for k in first)
    assert [k for k in first if first[k] != second[k]] == []


def test_only_clock_readings_differ_in_final_json_and_the_metric_stream(two_trainings):
    a, b = two_trainings
    for name in ("final.json", "metrics.jsonl"):
        # final.json names its checkpoint by path: the output directories differ, nothing else may
        text_a, text_b = ((d / name).read_text().replace(str(d), "OUT") for d in (a, b))
        assert without_timings(text_a) == without_timings(text_b), name


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators", "eyas"])
def test_the_same_checkpoint_exports_to_the_same_bytes(two_trainings, tmp_path, fmt):
    from eyas.train.checkpoint import latest_complete

    checkpoint = latest_complete(two_trainings[0])
    script = (
        "import sys; from eyas.export.convert import export_checkpoint; "
        "export_checkpoint(sys.argv[1], sys.argv[2], to=sys.argv[3])"
    )
    for seed in (3, 4):
        fresh(["-c", script, str(checkpoint), str(tmp_path / f"out-{seed}"), fmt], seed)
    first, second = tree_bytes(tmp_path / "out-3"), tree_bytes(tmp_path / "out-4")
    assert first.keys() == second.keys() and first
    assert [k for k in first if first[k] != second[k]] == []
