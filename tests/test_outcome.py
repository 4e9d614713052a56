"""What a person reads at the end of a stage and of `eyas demo`: sentences and rounded figures, not dicts."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from eyas.config import load_run_config

REPO = Path(__file__).resolve().parents[1]
RESULT = {
    "engine": "reference",
    "num_prompts": 16,
    "steps": 3,
    "tau_mean": 2.371812345,
    "tau_ngram": 1.5312,
    "tau_random": 1.0,
    "accept_rate_per_position": [0.62512, 0.446, 0.33749],
    "speedup_vs_greedy": 0.8812,
    "speedup_ngram_vs_greedy": 1.1049,
    "lossless": True,
    "path": "runs/demo/bench/benchmark.json",
}


def test_the_demo_ends_with_rounded_figures_the_drafter_and_its_serving_command(capsys):
    from eyas_cli.main import print_outcome

    config = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    print_outcome(config, RESULT)
    out = capsys.readouterr().out
    assert "benchmark (reference engine, 16 held-out prompts, chains of 3):" in out
    assert "tau (tokens per verify step)  2.37   n-gram 1.53   random draft 1.00" in out
    assert "acceptance per position       0.63, 0.45, 0.34" in out
    assert "speedup vs greedy             0.88x   n-gram 1.10x" in out
    assert "lossless (output = greedy)    yes" in out
    export = config.paths.export_dir / "sglang"
    assert f"drafter (SGLang format): {export}" in out
    assert f"{shlex.quote(sys.executable)} -m sglang.launch_server" in out and f"--speculative-draft-model-path {export} " in out
    assert "{" not in out and "2.3718" not in out


def test_an_engine_that_measures_less_prints_less():
    from eyas.bench.acceptance import describe_benchmark

    lines = describe_benchmark({"engine": "sglang", "steps": 3, "tau_mean": 2.5, "accept_rate_per_position": []})
    assert lines[1].strip() == "tau (tokens per verify step)  2.50   n-gram -   random draft -"
    assert not any("speedup" in line or "lossless" in line for line in lines)


def test_stage_summaries_are_sentences():
    from eyas.extract.coordinator import summary_sentence
    from eyas.verify.report import VerifyReport

    extraction = {
        "shards_total": 38, "shards_written": 3, "shards_skipped": 35, "unlisted_rewritten": 0, "strays_removed": 1,
        "samples_total": 638, "tokens_written": 4210, "tokens_total": 52010, "seconds": 3.07, "aux_layer_ids": [2, 4, 5],
        "hidden_size": 128, "num_workers": 1, "storage": "runs/demo/shards",
    }  # fmt: skip
    assert summary_sentence(extraction) == (
        "extraction: 3 shards written and 35 already done, of 38 (4,210 of 52,010 tokens, 638 samples) in 3.1 s by "
        "1 worker into runs/demo/shards; aux layers [2, 4, 5], hidden size 128; 1 stray files removed"
    )
    verification = {
        "mode": "full", "shards": 38, "ok": 38, "bad": 0, "tokens": 52010, "bytes": 83 << 20, "problems": 0,
        "seconds": 1.234, "heal_rounds": 1, "quarantined": 2, "report": "runs/demo/verify/report.parquet",
    }  # fmt: skip
    assert VerifyReport.describe(verification) == (
        "verification (full): 38 of 38 shards ok, 0 bad (52,010 tokens, 83.0 MiB in 1.2 s); 2 quarantined and "
        "re-extracted in 1 healing round; report runs/demo/verify/report.parquet"
    )
