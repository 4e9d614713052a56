"""Runs the `eyas` command once per row, each in its own process, without paying the interpreter's and the CLI's
start (about a second a command) per row: this script imports the CLI once, then forks one process per row that
runs `eyas_cli.main.main(argv)` as `python -m eyas_cli.main ARGV` would, with the row's environment, its own
stdout and stderr (files) and its exit code. Nothing that starts threads of its own (prefect, pyarrow) is imported
before the fork; torch is (it starts none at import, and forking after it is how its data loaders work).

    python tests/cli_rows.py ROWS.json RESULTS.json PARALLEL
    ROWS.json: [{"argv": [...], "env": {...}}, ...]   RESULTS.json: [{"code", "stdout", "stderr", "seconds"}, ...]
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(row: dict, out: Path) -> None:
    """In the forked process: the row's command; never returns."""
    code = 99
    try:
        with open(out / "stdout", "wb") as so, open(out / "stderr", "wb") as se:
            os.dup2(so.fileno(), 1)
            os.dup2(se.fileno(), 2)
        os.environ.update(row.get("env", {}))
        from eyas_cli.main import main

        try:
            code = main(row["argv"])
        except SystemExit as done:  # argparse's refusals
            code = done.code if isinstance(done.code, int) else 2
    except BaseException:  # noqa: BLE001 -- the runner's own failure, shown in the row's stderr
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_rows(rows: list[dict], work: Path, parallel: int) -> list[dict]:
    """Each row's {code, stdout, stderr}, at most `parallel` rows running at once."""
    running: dict[int, int] = {}
    started: dict[int, float] = {}
    results: list[dict | None] = [None] * len(rows)

    def reap() -> None:
        pid, status = os.wait()
        i = running.pop(pid)
        out = work / f"row-{i}"
        results[i] = {"code": os.waitstatus_to_exitcode(status), "stdout": (out / "stdout").read_text(errors="replace"),
                      "stderr": (out / "stderr").read_text(errors="replace"),
                      "seconds": round(time.monotonic() - started.pop(i), 2)}  # fmt: skip

    for i, row in enumerate(rows):
        while len(running) >= parallel:
            reap()
        out = work / f"row-{i}"
        out.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(row, out)
        running[pid], started[i] = i, time.monotonic()
    while running:
        reap()
    return results


def main() -> None:
    rows_path, results_path, parallel = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    import eyas.config  # noqa: F401 -- what the rows need, imported once: the CLI, the config, torch
    import eyas.export.keys  # noqa: F401
    import eyas.target  # noqa: F401
    import eyas_cli.errors  # noqa: F401
    import eyas_cli.main
    import eyas_cli.path_errors  # noqa: F401

    eyas_cli.main.parse_args(["status"])  # imports what the parser's choices need
    rows = json.loads(Path(rows_path).read_text())
    results = run_rows(rows, Path(results_path).parent / "rows", parallel)
    Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
