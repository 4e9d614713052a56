"""bench/verify.py runs on tiny sizes and ends with its JSON figures (speed is never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_prints_its_figures_as_the_last_line(tmp_path):
    args = ["--num-shards", "2", "--shard-mib", "1", "--num-headers", "20", "--repeats", "1", "--dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "verify.py"), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["full_vs_cat_ratio"] > 0 and figures["cheap_40k_s"] > 0 and figures["num_headers"] == 20
    assert "ratio to cat" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # everything it wrote is removed
