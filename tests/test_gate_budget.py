"""The combined budget of a streamed run at the gate (eyas.gate.budget): the extraction scaled from the smoke run's
extraction, the shards' bytes from the plan (and the retention window's bound), the regeneration as the dataset
stage reported it, and the budget in the gate summary's three layouts only when the smoke extraction is given.
Real facts: the tiny target and a tokenized table."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from run_fixtures import write_tokenized

from eyas.config import load_run_config
from eyas.extract.plan import describe_extraction
from eyas.facts import facts_for
from eyas.gate.budget import bytes_text, duration_text, streaming_budget
from eyas.gate.summary import gate_summary
from eyas.shards.encoding import extract_encoding
from eyas.train.launch import training_estimate

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "fixtures" / "tiny-target"
SMOKE = {"first_loss": 6.5, "last_loss": 2.25, "steps": 20, "samples": 8, "passed": True, "tokens_per_s": 5000.0,
         "device": "cpu", "modules": [{"module": "fc", "num_params": 12, "shapes": {"weight": [2, 6]},
                                       "trainable": True}]}  # fmt: skip
DEVICES = {"backend": "gloo", "num_processes": 2, "ok": True, "devices": []}
DATASET = {"responses": "regenerate", "generator": "sglang", "num_samples": 200, "seconds": 5400.0, "reused": False}
EXTRACTED = {"tokens_written": 3000, "seconds": 1.5, "num_workers": 2}  # 1,000 tokens/s per worker


def run_config(workdir: Path, *, extract: dict = (), generation: dict = ()):
    config = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    gen = config.dataset.generation.model_copy(update=dict(generation))
    return config.model_copy(update={
        "workdir": str(workdir),
        "extract": config.extract.model_copy(update={"shard_bytes": 1 << 16, "num_workers": 4, **dict(extract)}),
        "dataset": config.dataset.model_copy(update={"generation": gen}),
    })  # fmt: skip


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    rng = random.Random(3)
    samples = [[rng.randrange(1, 1000) for _ in range(rng.randint(20, 90))] for _ in range(200)]
    root = tmp_path_factory.mktemp("budget")
    tokenized = write_tokenized(root / "tokenized.parquet", samples)
    return facts_for(target_path=TINY, tokenized_path=tokenized, shards_dir=root / "shards")


def test_extraction_is_scaled_from_the_smoke_extraction_to_the_plans_tokens(facts, tmp_path):
    config = run_config(tmp_path)
    budget = streaming_budget(config, facts, dataset=DATASET, extracted=EXTRACTED, smoke=SMOKE)
    tokens = sum(p.num_tokens for p in describe_extraction(config.extract, facts)[1])
    ext = budget["extraction"]
    assert (ext["tokens"], ext["tokens_per_s"], ext["workers"]) == (tokens, 1000.0, 4)
    assert ext["wall_s"] == pytest.approx(tokens / 4000)
    assert ext["device_hours"] == pytest.approx(tokens / 4000 * 4 / 3600)
    assert ext["unit"] == "CPU worker-hours"
    assert budget["training"] == training_estimate(config, facts, SMOKE)
    assert budget["total_device_hours"] is None  # CPU figures are not GPU-hours to add up


def test_an_sglang_extraction_counts_each_workers_tensor_parallel_gpus(facts, tmp_path):
    config = run_config(tmp_path, extract={"backend": "sglang", "num_workers": 2})
    config = config.model_copy(update={"extract": config.extract.model_copy(
        update={"sglang": config.extract.sglang.model_copy(update={"tp_size": 4})})})  # fmt: skip
    ext = streaming_budget(config, facts, dataset=DATASET, extracted=EXTRACTED, smoke=SMOKE)["extraction"]
    assert (ext["devices"], ext["unit"]) == (8, "GPU-hours")
    assert ext["device_hours"] == pytest.approx(ext["wall_s"] * 8 / 3600)


def test_a_smoke_extraction_that_timed_nothing_gives_no_figure(facts, tmp_path):
    config = run_config(tmp_path)
    empty = {"tokens_written": 0, "seconds": 0.2, "num_workers": 1}
    summary = gate_summary(config, facts, dataset=DATASET, verified={}, smoke=SMOKE, devices=DEVICES, extracted=empty)
    tokens = sum(p.num_tokens for p in describe_extraction(config.extract, facts)[1])
    assert (
        f"- **budget** extraction: {tokens:,} tokens on 4 workers; no time figure: the smoke run's extraction "
        "wrote no tokens it timed"
    ) in summary.dialog


def test_storage_is_the_plans_bytes_at_the_encoding_and_a_window_bounds_it(facts, tmp_path):
    keep = run_config(tmp_path, extract={"aux_dtype": "float8_e4m3"})
    window = run_config(tmp_path, extract={"aux_dtype": "float8_e4m3", "retention": 3})
    plan = describe_extraction(keep.extract, facts)[1]
    bpt = extract_encoding(keep.extract).bytes_per_token(hidden_size=facts.hidden_size, num_aux=facts.num_aux)
    sizes = sorted((p.num_tokens * bpt for p in plan), reverse=True)
    assert len(plan) > 3
    kept = streaming_budget(keep, facts, dataset=DATASET, extracted=EXTRACTED, smoke=SMOKE)["storage"]
    assert (kept["bytes_total"], kept["bytes_bound"], kept["retention"]) == (sum(sizes), sum(sizes), "keep")
    bounded = streaming_budget(window, facts, dataset=DATASET, extracted=EXTRACTED, smoke=SMOKE)["storage"]
    assert (bounded["bytes_total"], bounded["bytes_bound"]) == (sum(sizes), sum(sizes[:3]))
    lines = gate_summary(window, facts, dataset=DATASET, verified={}, smoke=SMOKE, devices=DEVICES,
                         extracted=EXTRACTED).full  # fmt: skip
    assert (
        f"- storage: {len(plan):,} shards, {bytes_text(sum(sizes))} in the run's shards dir (aux float8_e4m3, "
        f"teacher last_hidden float32, {bpt:,} bytes/token); retention 3 shards: at most {bytes_text(sum(sizes[:3]))} "
        "at once, each shard deleted once the trainer's newest checkpoint is past its last use (single epoch)"
    ) in lines


def test_regeneration_states_the_dataset_stages_time_and_the_gpus_eyas_launched(facts, tmp_path):
    launched = run_config(tmp_path, generation={"generator": "sglang", "sglang_tp_size": 4})
    r = streaming_budget(launched, facts, dataset=DATASET, extracted=EXTRACTED, smoke=SMOKE)["regeneration"]
    assert (r["seconds"], r["devices"], r["device_hours"]) == (5400.0, 4, 6.0)
    text = gate_summary(launched, facts, dataset=DATASET, verified={}, smoke=SMOKE, devices=DEVICES,
                        extracted=EXTRACTED).dialog  # fmt: skip
    assert "- **budget** regeneration: 200 responses by sglang in 1.5 h, 6.00 GPU-hours on 4 GPUs" in text
    given = run_config(tmp_path, generation={"generator": "openai", "server_urls": ["http://gen:8000"],
                                             "openai_model": "m"})  # fmt: skip
    r = streaming_budget(given, facts, dataset={**DATASET, "generator": "openai"}, extracted=EXTRACTED, smoke=SMOKE)
    assert r["regeneration"]["device_hours"] is None
    as_given = streaming_budget(launched, facts, dataset={**DATASET, "responses": "as_given"}, extracted=EXTRACTED,
                                smoke=SMOKE)  # fmt: skip
    assert as_given["regeneration"]["seconds"] is None


def test_the_budget_shows_in_every_layout_only_with_the_smoke_extraction(facts, tmp_path):
    config = run_config(tmp_path)
    args = dict(dataset=DATASET, verified={}, smoke=SMOKE, devices=DEVICES)
    offline = gate_summary(config, facts, **args)
    streamed = gate_summary(config, facts, **args, extracted=EXTRACTED)
    assert "\nBudget " not in offline.terminal and "**budget**" not in offline.dialog
    assert "Combined budget" not in offline.full
    ext = streaming_budget(config, facts, dataset=DATASET, extracted=EXTRACTED, smoke=SMOKE)["extraction"]
    line = (
        f"extraction: about {duration_text(ext['wall_s'])} wall, {ext['device_hours']:.2f} CPU worker-hours "
        f"({ext['tokens']:,} tokens on 4 workers at the smoke extraction's 1,000 tokens/s each)"
    )
    assert line in " ".join(streamed.terminal.split()) and "Budget    regeneration:" in streamed.terminal
    assert f"- **budget** {line}" in streamed.dialog
    assert "## Combined budget\n\n- regeneration: " in streamed.full and f"- {line}" in streamed.full
    assert max(len(row) for row in streamed.terminal.splitlines()) <= 80
