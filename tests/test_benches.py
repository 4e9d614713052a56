"""Every bench script runs in its quick mode (small sizes, the same code path) and ends with its JSON figures, holding
the keys bench/README.md's table names for it, and removes what it wrote. Speed is never asserted: a bench that
breaks, or stops printing a figure it documents, fails here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
README = BENCH / "README.md"
QUICK_TIMEOUT_S = 300


def bench_scripts() -> list[str]:
    """The scripts of bench/: the files with an `if __name__ == "__main__":` entry (helpers they import, such as
    measure.py, have none)."""
    entry = re.compile(r"""^if __name__ == ["']__main__["']:""", re.MULTILINE)
    return sorted(p.name for p in BENCH.glob("*.py") if entry.search(p.read_text()))


def readme_figures() -> dict[str, list[str]]:
    """{script: the figure keys its row names} from bench/README.md's table (columns `bench` and `figures ...`)."""
    rows = [line.split("|")[1:-1] for line in README.read_text().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in rows[0]]
    column = next(i for i, cell in enumerate(header) if cell.startswith("figures"))
    return {
        row[0].strip().strip("`"): re.findall(r"`([^`]+)`", row[column])
        for row in rows[2:]  # past the header and its |---| line
    }


def test_every_readme_row_names_a_bench_script_and_figures():
    figures = readme_figures()
    assert sorted(figures) == bench_scripts(), "bench/README.md's table and the scripts of bench/ differ"
    assert all(figures.values()), [name for name, keys in figures.items() if not keys]


@pytest.mark.parametrize("script", bench_scripts())
def test_quick_run_prints_the_figures_the_readme_names(script, tmp_path):
    keys = readme_figures().get(script)
    assert keys, f"bench/{script}: no row in bench/README.md's table; add one naming the figures its last line holds"
    # one torch thread: on a busy 2-core machine two OpenMP threads per process spin and run many times slower
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    env.pop("PREFECT_API_URL", None)  # a bench that needs a server starts its own
    proc = subprocess.run([sys.executable, str(BENCH / script), "--quick"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=QUICK_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, f"bench/{script} --quick exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    try:
        printed = json.loads(last)
    except json.JSONDecodeError:
        pytest.fail(f"bench/{script} --quick: the last line of its output is not JSON: {last[-300:]!r}")
    missing = [key for key in keys if key not in printed]
    assert not missing, (
        f"bench/{script} --quick: its JSON lacks {missing} (bench/README.md names them); has {sorted(printed)}"
    )
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("torch"))  # torch's own caches stay
    assert not left, f"bench/{script} --quick left {left} in its temporary directory; remove what it writes"
