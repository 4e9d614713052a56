"""eyas.shards.read_checks: shard checksums hashed once per launch on a node, by real concurrent processes.

Each worker is a separate Python process (as torchrun's ranks are) verifying plain files against manifest rows;
it prints its problems and its stats as JSON.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyas.checksum import checksum_file
from eyas.shards.manifest import ManifestRow
from eyas.shards.read_checks import NodeReadChecks, launch_name

REPO = Path(__file__).resolve().parents[1]
NUM_SHARDS, NUM_PROCESSES = 6, 4

WORKER = """
import json, os, sys, time
from pathlib import Path
from eyas.shards.manifest import ManifestRow
from eyas.shards.read_checks import NodeReadChecks
args = json.loads(sys.argv[1])
rows = [ManifestRow(**r) for r in args["rows"]]
if args["folder"] is None:
    checks = NodeReadChecks.for_this_launch(args["root"])
else:
    checks = NodeReadChecks(args["folder"])
if args.get("stall"):  # a rank that dies while hashing: it announces the hash, then never finishes it
    def stalled(path):
        Path(args["stall"]).write_text("hashing")
        time.sleep(60)
    checks._hash = stalled
if args.get("ready"):
    Path(args["ready"]).write_text("ready")  # as a trainer's rank: its checks open before any rank can finish
while not Path(args["go"]).exists():
    time.sleep(0.005)
order = args["order"]
problems = {rows[i].file: checks.checksum_problem(rows[i], Path(args["shards"]) / rows[i].file) for i in order}
print(json.dumps({"problems": problems, "stats": vars(checks.stats), "folder": str(checks.folder)}), flush=True)
if args.get("killed"):
    os._exit(0)  # ends as a killed process does: no close, no exit handlers
"""


def write_shards(shards: Path, num: int = NUM_SHARDS) -> list[ManifestRow]:
    shards.mkdir()
    rows = []
    for i in range(num):
        path = shards / f"shard-{i:05d}.safetensors"
        path.write_bytes(os.urandom(100_000 + 1_000 * i))
        rows.append(ManifestRow(i, path.name, 10 * i, 10 * i + 10, 100, path.stat().st_size, checksum_file(path)))
    return rows


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-7] ^= 0xFF
    path.write_bytes(bytes(data))


def start(args: dict, *, env: dict | None = None) -> subprocess.Popen:
    outside = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}  # a launch of its own
    env = {**outside, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, json.dumps(args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )


def finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    return json.loads(out)


def run_together(tmp_path: Path, rows: list[ManifestRow], *, folder, root=None, env=None, n=NUM_PROCESSES,
                 killed=False):  # fmt: skip
    """n workers, released at once when all have opened their checks, each verifying every shard in its own
    rotated order; `killed`: they end without closing, as killed ranks do."""
    stamp = time.monotonic_ns()
    go, ready = tmp_path / f"go-{stamp}", [tmp_path / f"ready-{stamp}-{k}" for k in range(n)]
    base = {"rows": [vars(r) for r in rows], "shards": str(tmp_path / "shards"), "go": str(go), "killed": killed}
    base |= {"folder": None if folder is None else str(folder), "root": None if root is None else str(root)}
    procs = [
        start(base | {"order": [(k + j) % len(rows) for j in range(len(rows))], "ready": str(ready[k])}, env=env)
        for k in range(n)
    ]
    deadline = time.monotonic() + 60
    while not all(path.exists() for path in ready):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "a worker ended before ready"
        time.sleep(0.005)
    go.write_text("go")
    return [finish(p) for p in procs]


def test_four_processes_hash_the_shard_set_once_and_all_find_it_sound(tmp_path):
    rows = write_shards(tmp_path / "shards")
    results = run_together(tmp_path, rows, folder=tmp_path / "launch")
    assert all(problem is None for r in results for problem in r["problems"].values())
    assert sum(r["stats"]["bytes_hashed"] for r in results) == sum(row.num_bytes for row in rows)
    assert sum(r["stats"]["shards_hashed"] for r in results) == NUM_SHARDS
    assert sum(r["stats"]["shards_trusted"] for r in results) == (NUM_PROCESSES - 1) * NUM_SHARDS


def test_a_flipped_shard_is_refused_by_name_by_every_process_that_needs_it(tmp_path):
    rows = write_shards(tmp_path / "shards")
    flip(tmp_path / "shards" / rows[3].file)
    found = checksum_file(tmp_path / "shards" / rows[3].file)
    results = run_together(tmp_path, rows, folder=tmp_path / "launch")
    message = (
        f"shard shard-00003.safetensors: checksum {found[:25]}..., the manifest says {rows[3].checksum[:25]}...; "
        "its bytes changed after extraction: run eyas verify, which quarantines and re-extracts it"
    )
    assert [r["problems"] for r in results] == [
        {row.file: message if row.shard_index == 3 else None for row in rows}
    ] * 4
    assert sum(r["stats"]["bytes_hashed"] for r in results) == sum(row.num_bytes for row in rows)


def test_ranks_of_one_torchrun_launch_share_records_and_a_restart_hashes_again(tmp_path):
    rows = write_shards(tmp_path / "shards")
    root, total = tmp_path / "root", sum(row.num_bytes for row in rows)
    rank = {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "0"}
    first = run_together(tmp_path, rows, folder=None, root=root, env=rank, n=2)
    assert first[0]["folder"] == first[1]["folder"]  # both are children of this process, as ranks of the agent
    assert sum(r["stats"]["bytes_hashed"] for r in first) == total
    again = run_together(tmp_path, rows, folder=None, root=root, env=rank | {"TORCHELASTIC_RESTART_COUNT": "1"}, n=2)
    assert again[0]["folder"] != first[0]["folder"]
    assert sum(r["stats"]["bytes_hashed"] for r in again) == total  # the restart's launch trusts no earlier record


def test_a_record_from_an_ended_launch_is_not_trusted_and_its_folder_is_deleted(tmp_path):
    rows = write_shards(tmp_path / "shards")
    root, total = tmp_path / "root", sum(row.num_bytes for row in rows)
    (earlier,) = run_together(tmp_path, rows, folder=None, root=root, n=1, killed=True)  # outside torchrun
    assert earlier["stats"]["bytes_hashed"] == total and Path(earlier["folder"]).is_dir()
    (later,) = run_together(tmp_path, rows, folder=None, root=root, n=1)
    assert later["stats"] == {"shards_hashed": NUM_SHARDS, "bytes_hashed": total, "shards_trusted": 0}
    assert not Path(earlier["folder"]).exists()  # its launcher ended: pruned when the later one opened


def test_the_last_process_of_a_launch_to_close_deletes_its_folder_and_the_empty_root(tmp_path):
    rows = write_shards(tmp_path / "shards")
    root, rank = tmp_path / "root", {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "0"}
    (root / "a-folder-of-another-launch").mkdir(parents=True)
    first = run_together(tmp_path, rows, folder=None, root=root, env=rank, n=2)  # both close at exit
    assert sum(r["stats"]["bytes_hashed"] for r in first) == sum(row.num_bytes for row in rows)
    assert sorted(p.name for p in root.iterdir()) == ["a-folder-of-another-launch"]
    (root / "a-folder-of-another-launch").rmdir()
    run_together(tmp_path, rows, folder=None, root=root, n=1)
    assert not root.exists()
    checks = NodeReadChecks.for_this_launch(root)  # in this process: open, checked, closed
    assert checks.checksum_problem(rows[0], tmp_path / "shards" / rows[0].file) is None
    assert checks.folder.is_dir()
    checks.close()
    assert not root.exists()
    checks.close()  # closing again does nothing


def test_a_process_killed_while_hashing_leaves_no_record_and_the_next_hashes_the_shard(tmp_path):
    rows = write_shards(tmp_path / "shards", 1)
    folder, stall, go = tmp_path / "launch", tmp_path / "stalled", tmp_path / "go"
    go.write_text("go")
    args = {"rows": [vars(rows[0])], "shards": str(tmp_path / "shards"), "go": str(go), "folder": str(folder)}
    proc = start(args | {"root": None, "order": [0], "stall": str(stall)})
    deadline = time.monotonic() + 30
    while not stall.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
        time.sleep(0.01)
    (lock,) = folder.glob("*.lock")
    with open(lock) as f, pytest.raises(BlockingIOError):  # the dying rank holds the shard's lock
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert not list(folder.glob("*.json"))  # no record claims the shard is sound
    checks = NodeReadChecks(folder)
    assert checks.checksum_problem(rows[0], tmp_path / "shards" / rows[0].file) is None
    assert (checks.stats.shards_hashed, checks.stats.bytes_hashed) == (1, rows[0].num_bytes)
    assert len(list(folder.glob("*.json"))) == 1


def test_a_shard_rewritten_after_its_record_is_hashed_again(tmp_path):
    rows = write_shards(tmp_path / "shards", 1)
    path = tmp_path / "shards" / rows[0].file
    assert NodeReadChecks(tmp_path / "launch").checksum_problem(rows[0], path) is None
    flip(path)
    later = NodeReadChecks(tmp_path / "launch")
    assert later.checksum_problem(rows[0], path).startswith("shard shard-00000.safetensors: checksum xxh3-128:")
    assert (later.stats.shards_hashed, later.stats.shards_trusted) == (1, 0)


def test_check_ahead_hashes_unclaimed_shards_without_waiting_and_others_trust_them(tmp_path):
    rows = write_shards(tmp_path / "shards")
    shards = [(row, tmp_path / "shards" / row.file) for row in rows]
    ahead = NodeReadChecks(tmp_path / "launch")
    busy = ahead._lock_path(shards[0][1])
    with open(busy, "w") as held:  # another rank is hashing shard 0
        fcntl.flock(held, fcntl.LOCK_EX)
        assert ahead.check_ahead(shards) == NUM_SHARDS - 1
    reader = NodeReadChecks(tmp_path / "launch")
    assert all(reader.checksum_problem(row, path) is None for row, path in shards)
    assert (reader.stats.shards_hashed, reader.stats.shards_trusted) == (1, NUM_SHARDS - 1)


def test_without_a_folder_every_check_hashes(tmp_path):
    rows = write_shards(tmp_path / "shards", 1)
    checks = NodeReadChecks(None)
    for _ in range(2):
        assert checks.checksum_problem(rows[0], tmp_path / "shards" / rows[0].file) is None
    assert checks.stats.bytes_hashed == 2 * rows[0].num_bytes


def test_the_launch_is_this_process_outside_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    name = launch_name()
    assert name is not None and name.split("_")[-3] == str(os.getpid()) and name.endswith("_0")
