"""Prefect's share of the tiny pipeline's wall time, and what one Prefect task costs.

    .venv/bin/python bench/orchestration.py [--repeats 2] [--quick] [--torch-threads 1] [--num-tasks 200] [--keep DIR]

Prefect's share. The same work is done twice, each time in a fresh work directory and in its own Python
process started by this script (so imports count), one after the other on the same machine:
  - library: the library's stage entries as plain calls, the very calls the tasks make, in the pipeline's
    order (dataset + vocab, extraction, verification, smoke run, device preflight, torchrun training,
    export, reference benchmark), and nothing else;
  - prefect: the `pipeline` flow against a real local Prefect server (SQLite) that this script starts on a
    free port with a fresh database.
prefect_share = (prefect_s - library_s) / prefect_s. The difference is everything the Prefect path adds and
nothing else, since both do the same work on the same inputs: importing prefect, flow- and task-run
bookkeeping over HTTP, state changes, logs, progress bars and artifacts (the loss curve, the acceptance
plots), the extraction monitor's polling, and the server competing for the same cores. The approval gate is
answered in advance in both (approval.json recorded for this configuration, as after an earlier approval):
how long a person takes to answer is not orchestration. The CPU seconds of each path (the process and its
children, torchrun's included) and of the server are measured too; cpu_share = (prefect + server - library)
/ (prefect + server) is a second view of the same difference. On 2 cores the training
stage alone varies by a few seconds between runs, which bounds the precision of the difference; and since the
paths run one after the other, other work on the machine meanwhile skews it (two torch threads on two busy
cores can run several times slower). So the CPU seconds every other process used during each path (from
/proc/stat) are printed beside them, and `--repeats N` runs each path N times, alternating which goes first,
and counts the fastest run of each (the least disturbed). The per-stage table shows the Prefect side as the
server recorded each flow or task run.

Both paths run with OMP_NUM_THREADS=1 (`--torch-threads`; torchrun's workers always do): on a 2-core machine
that other work shares, two OpenMP threads per process spin at their barriers whenever one of them is
descheduled, and a stage then runs many times slower (seen here: the dataset stage took 19 s in one run and
560 s in the next), which no difference between two runs survives. One thread per process makes the work
steady; it also makes the in-process stages slower than in `make demo`, so the share is of a somewhat longer
pipeline than the demo's.

Per-task overhead. Inside one flow run, `--num-tasks` calls of a trivial task (returns its argument + 1)
one after another, against as many plain calls of the same function; task_overhead_ms = (tasks_s -
plain_s) / N. flow_overhead_ms is the wall time of calling an empty flow (one flow run), averaged over 10 (2 with --quick).

`--quick` runs the same paths on the preset cut to seconds (bench/measure.py's quick_config: 12 prompts, 4
training steps on one process, a 10-step smoke run, 2 benchmark prompts) and 20 tasks, for the test suite (about a
minute: the server's start and three processes' imports); Prefect's fixed costs then weigh more, so the share comes
out far larger. The last line is one JSON object with the figures (prefect_share, task_overhead_ms, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from measure import quick_config  # noqa: E402

# (stage in the table, library timer name, the names of the Prefect runs that did it)
STAGES = (
    ("dataset + vocab", "dataset", ("build-dataset",)),
    ("extraction", "extract", ("extract-hidden-states",)),
    ("verification", "verify", ("verify-shards",)),
    ("smoke run + preflight", "smoke", ("smoke-run", "device-preflight", "gate-summary")),
    ("training (torchrun)", "train", ("train-drafter",)),
    ("export", "export", ("export-drafter",)),
    ("benchmark", "bench", ("benchmark-acceptance",)),
)


def bench_config(workdir: Path, quick: bool):
    from eyas.config import load_run_config

    config = load_run_config(REPO / "deployments" / "tiny-cpu.json").model_copy(update={"workdir": str(workdir)})
    return quick_config(config) if quick else config


class Timer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        return out


def run_library(config) -> dict:
    """The pipeline's work as plain calls of the library's stage entries (the calls the tasks make), timed per stage."""
    from eyas.bench.acceptance import bench_run
    from eyas.dataset.build import build_dataset
    from eyas.dataset.vocab import build_vocab
    from eyas.export.convert import export_run
    from eyas.extract.coordinator import run_extraction
    from eyas.facts import resolve_facts
    from eyas.train.launch import train_run
    from eyas.train.preflight import preflight_run
    from eyas.train.smoke import smoke_run
    from eyas.verify.shard_set import raise_if_bad, verify_run

    timer = Timer()
    timer("dataset", lambda: (build_dataset(config), build_vocab(config)))
    facts = resolve_facts(config)
    timer("extract", run_extraction, config.extract, facts, target_dtype=config.target.dtype)
    timer("verify", lambda: raise_if_bad(verify_run(config, facts)))
    timer("smoke", lambda: (smoke_run(config, facts), preflight_run(config)))
    timer("train", train_run, config, facts)
    export_dir = timer("export", export_run, config)
    result = timer("bench", bench_run, config, export_dir)
    return {"stages": timer.seconds, "tau_mean": result["tau_mean"]}


def run_prefect(config) -> dict:
    """The pipeline flow against the server at PREFECT_API_URL; per-stage times as the server recorded them."""
    from prefect.client.orchestration import get_client

    from eyas.gate.approval import gate_fingerprint, write_approval
    from flows.pipeline import pipeline

    record = {"approve": True, "reviewer": "bench", "note": "answered in advance: not orchestration time"}
    write_approval(config, record | {"config_fingerprint": gate_fingerprint(config), "decided_at": "bench"})
    started = datetime.now(timezone.utc)
    state = pipeline(config, return_state=True)
    if not state.is_completed():
        raise RuntimeError(f"pipeline ended {state.name}: {state.message}")
    with get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows(limit=200)}
        flow_runs = [(flows[r.flow_id], r) for r in client.read_flow_runs(limit=200)]
        task_runs = [(r.name.rsplit("-", 1)[0], r) for r in client.read_task_runs(limit=200)]
    # a subflow also has a task run in its parent, named after the flow: counted once, as the flow run
    task_runs = [(name, run) for name, run in task_runs if name not in flows.values()]
    recorded: dict[str, float] = {}
    # this pipeline's runs only (the server also holds earlier repeats')
    flow_runs = [(name, run) for name, run in flow_runs if run.start_time and run.start_time >= started]
    task_runs = [(name, run) for name, run in task_runs if run.start_time and run.start_time >= started]
    for name, run in flow_runs + task_runs:
        if run.end_time:
            recorded[name] = recorded.get(name, 0.0) + (run.end_time - run.start_time).total_seconds()
    counts = {"num_flow_runs": len(flow_runs), "num_task_runs": len(task_runs)}
    return {"recorded": recorded, **counts, "tau_mean": state.result()["tau_mean"]}


def run_tasks(num_tasks: int, num_flows: int) -> dict:
    """N trivial task calls vs N plain calls in one flow run; an empty flow's wall time."""
    from prefect import flow, task

    def plus_one(x: int) -> int:
        return x + 1

    trivial = task(plus_one, name="plus-one")

    @flow(name="bench-task-overhead")
    def overhead(n: int) -> dict:
        t0 = time.perf_counter()
        for i in range(n):
            plus_one(i)
        plain = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(n):
            trivial(i)
        return {"plain_s": plain, "tasks_s": time.perf_counter() - t0}

    @flow(name="bench-empty-flow")
    def empty() -> None:
        return None

    empty()  # the first flow run pays for one-time client set-up
    t0 = time.perf_counter()
    for _ in range(num_flows):
        empty()
    flow_s = (time.perf_counter() - t0) / num_flows
    return {**overhead(num_tasks), "num_tasks": num_tasks, "flow_s": flow_s}


def child(role: str, workdir: Path, quick: bool, num_tasks: int) -> None:
    if role == "tasks":
        result = run_tasks(num_tasks, 2 if quick else 10)
    else:
        config = bench_config(workdir, quick)
        result = run_library(config) if role == "library" else run_prefect(config)
    print("BENCH_RESULT " + json.dumps(result, default=str), flush=True)


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in a process group (the server and its workers)."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields[0] is the state; pgrp is the 5th field of stat
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def busy_cpu_s() -> float:
    """CPU seconds every process of this machine has used since boot (/proc/stat, idle and iowait excluded)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def spawn(role: str, workdir: Path, args, env: dict, log_path: Path, server_pid: int) -> dict:
    """Run one role in its own process: its result, wall and CPU seconds (children included), the server's
    CPU seconds meanwhile, and the CPU seconds of every other process of the machine meanwhile."""
    cmd = [sys.executable, __file__, "--role", role, "--workdir", str(workdir), "--num-tasks", str(args.num_tasks)]
    cmd += ["--quick"] if args.quick else []
    print(f"running the {role} path (log: {log_path}) ...", flush=True)
    t0, busy0, server0 = time.perf_counter(), busy_cpu_s(), group_cpu_s(server_pid)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
    wall, busy, server = time.perf_counter() - t0, busy_cpu_s() - busy0, group_cpu_s(server_pid) - server0
    text = log_path.read_text()
    if status != 0 or "BENCH_RESULT " not in text:
        raise RuntimeError(f"the {role} path failed (status {status}); last lines of {log_path}:\n{text[-3000:]}")
    result = json.loads(text[text.rindex("BENCH_RESULT ") + len("BENCH_RESULT ") :].splitlines()[0])
    cpu = usage.ru_utime + usage.ru_stime
    return {**result, "wall_s": wall, "cpu_s": cpu, "server_cpu_s": server, "others_cpu_s": busy - cpu - server}


def measure(args, root: Path) -> dict:
    from eyas_cli.server import free_port, start_server

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    state_dir = root / "prefect-home"
    t0 = time.perf_counter()
    server = start_server(api, state_dir)
    server_start_s = time.perf_counter() - t0
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(state_dir)}
    if args.torch_threads:
        env |= {"OMP_NUM_THREADS": str(args.torch_threads), "MKL_NUM_THREADS": str(args.torch_threads)}
    env.pop("APPROVE", None)
    no_prefect = {k: v for k, v in env.items() if "PREFECT" not in k}
    runs: dict[str, list[dict]] = {"library": [], "prefect": []}
    try:
        for r in range(args.repeats):  # alternate the order, so that neither path always runs first
            for role in ("library", "prefect") if r % 2 == 0 else ("prefect", "library"):
                role_env = no_prefect if role == "library" else env
                workdir, log = root / f"{role}-run-{r}", root / f"{role}-{r}.log"
                runs[role].append(spawn(role, workdir, args, role_env, log, server.pid))
        tasks = spawn("tasks", root / "tasks", args, env, root / "tasks.log", server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    best = {role: min(results, key=lambda x: x["wall_s"]) for role, results in runs.items()}
    walls = {role: [round(x["wall_s"], 1) for x in results] for role, results in runs.items()}
    return {**best, "walls": walls, "tasks": tasks, "server_start_s": server_start_s}


def report(m: dict, quick: bool, torch_threads: int) -> dict:
    lib, pre, tasks = m["library"], m["prefect"], m["tasks"]
    threads = f"{torch_threads} torch thread(s) per process" if torch_threads else "torch's default threads"
    print(
        f"\nthe tiny pipeline ({'--quick' if quick else 'deployments/tiny-cpu.json'}), {os.cpu_count()} cores, {threads}"
    )
    print(f"  {'stage':26s} {'library s':>10s} {'prefect s':>10s}   (prefect: the runs the server recorded)")
    for label, timer, names in STAGES:
        recorded = sum(pre["recorded"].get(n, 0.0) for n in names)
        print(f"  {label:26s} {lib['stages'].get(timer, 0.0):10.1f} {recorded:10.1f}")
    print(f"  {'whole process':26s} {lib['wall_s']:10.1f} {pre['wall_s']:10.1f}   (imports included)")
    if len(m["walls"]["library"]) > 1:
        print(f"  {'every run (fastest counts)':26s} {m['walls']['library']} {m['walls']['prefect']}")
    print(
        f"  {'server CPU s':26s} {lib['server_cpu_s']:10.1f} {pre['server_cpu_s']:10.1f}   (idle during the library path)"
    )
    cores = os.cpu_count()
    print(
        f"  {'other processes, CPU s':26s} {lib['others_cpu_s']:10.1f} {pre['others_cpu_s']:10.1f}   "
        f"(load from outside this benchmark: {lib['others_cpu_s'] / lib['wall_s']:.2f} and "
        f"{pre['others_cpu_s'] / pre['wall_s']:.2f} of {cores} cores)"
    )
    print(f"  {'CPU s, process + children':26s} {lib['cpu_s']:10.1f} {pre['cpu_s']:10.1f}")
    added = pre["wall_s"] - lib["wall_s"]
    share = added / pre["wall_s"]
    prefect_cpu = pre["cpu_s"] + pre["server_cpu_s"]
    cpu_share = (prefect_cpu - lib["cpu_s"]) / prefect_cpu
    print(f"prefect_share: {share:.3f} of the wall time ({added:+.1f} s; goal <= 0.10); cpu_share {cpu_share:.3f}")
    if "num_task_runs" in pre:
        print(
            f"Prefect recorded {pre['num_flow_runs']} flow runs and {pre['num_task_runs']} task runs for the pipeline"
        )
    print(f"tau_mean: library {lib['tau_mean']:.3f}, prefect {pre['tau_mean']:.3f} (same work, same result)")
    overhead_ms = (tasks["tasks_s"] - tasks["plain_s"]) / tasks["num_tasks"] * 1000
    print(
        f"\n{tasks['num_tasks']} trivial tasks in one flow run: {tasks['tasks_s']:.2f} s; plain calls {tasks['plain_s'] * 1000:.2f} ms"
    )
    print(f"  task_overhead_ms {overhead_ms:.1f} per task ({1000 / overhead_ms:.0f} tasks/s at most)")
    print(
        f"  flow_overhead_ms {tasks['flow_s'] * 1000:.0f} per empty flow run; server ready in {m['server_start_s']:.1f} s"
    )
    return {
        "prefect_share": round(share, 4),
        "task_overhead_ms": round(overhead_ms, 2),
        "cpu_share": round(cpu_share, 4),
        "prefect_added_s": round(added, 2),
        "library_s": round(lib["wall_s"], 2),
        "prefect_s": round(pre["wall_s"], 2),
        "library_cpu_s": round(lib["cpu_s"], 2),
        "prefect_cpu_s": round(pre["cpu_s"], 2),
        "server_cpu_s": round(pre["server_cpu_s"], 2),
        "others_cpu_s_library": round(lib["others_cpu_s"], 1),
        "others_cpu_s_prefect": round(pre["others_cpu_s"], 1),
        "flow_overhead_ms": round(tasks["flow_s"] * 1000, 1),
        "num_tasks": tasks["num_tasks"],
        "pipeline_flow_runs": pre.get("num_flow_runs"),
        "pipeline_task_runs": pre.get("num_task_runs"),
        "server_start_s": round(m["server_start_s"], 1),
        "stages_library_s": {k: round(v, 2) for k, v in lib["stages"].items()},
        "tau_mean_library": round(lib["tau_mean"], 4),
        "tau_mean_prefect": round(pre["tau_mean"], 4),
        "quick": quick,
        "walls_s": m["walls"],
        "torch_threads": torch_threads,
        "cores": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the preset cut to seconds, 20 tasks (for the test suite)")
    parser.add_argument("--num-tasks", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each path (alternating); the fastest counts")
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="OMP_NUM_THREADS of both paths; 0 = torch's default (one per core)"
    )
    parser.add_argument("--keep", help="write everything under this directory and keep it (default: a temp dir)")
    parser.add_argument("--role", choices=["library", "prefect", "tasks"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick and not args.role:
        args.num_tasks = min(args.num_tasks, 20)
    if args.role:
        child(args.role, Path(args.workdir), args.quick, args.num_tasks)
        return
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="eyas-bench-orchestration-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        figures = report(measure(args, root), args.quick, args.torch_threads)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
