"""Set up this machine's worker for eyas's deployments (prefect.yaml), then run it.

Usage (the same as `eyas worker ...`):
  .venv/bin/eyas worker [--pool eyas-local] [--results-dir DIR] [--within-s 90] [--setup-only]
  .venv/bin/eyas deploy --name '*-tiny-cpu' | --all     # prefect deploy, then which worker to start and why

1. the work pool POOL (type process) exists;
2. the crash-detection automation is installed on the server (eyas_cli.automation);
3. `prefect worker start --pool POOL --type process` replaces this process, with in its environment
   (the flow runs it starts inherit it):
   - PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30: runs beat every 30 s (the automation marks them Crashed
     after --within-s without one);
   - PREFECT_RESULTS_LOCAL_STORAGE_PATH=DIR: where task results are persisted, so a run resumed after
     the approval gate or retried after a crash finds the finished stages (tasks/caching.py). DIR must
     survive the machine, as the workdirs must: default `.eyas/results` in the repository, beside the
     server's database (EYAS_STATE_DIR moves both);
   - EYAS_REPO: the repository, where prefect.yaml's pull step runs the flows.
The server is PREFECT_API_URL, or the local one eyas starts (`eyas_cli.server`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from eyas_cli.automation import HEARTBEAT_S, WITHIN_S, crash_window_s

REPO = Path(__file__).resolve().parents[1]
POOL = "eyas-local"


def worker_environment(results_dir: Path) -> dict[str, str]:
    """What the worker, and the flow runs it starts, need in their environment."""
    return {
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S),
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(Path(results_dir).resolve()),
        "EYAS_REPO": str(REPO),
    }


def job_template() -> dict:
    """Prefect's process job template with `stream_output` off by default: a flow run's stdout is then not a pipe to
    the worker, so a worker that dies alone (an OOM kill, a restart) leaves its runs running, instead of killing
    each at its next print with a broken pipe. Their output still reaches the run's logs (log_prints) and
    the trainer's RUN/train/torchrun.log; a new worker is not needed for them to finish (they beat themselves)."""
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    template["variables"]["properties"]["stream_output"]["default"] = False
    return template


def ensure_process_pool(name: str) -> bool:
    """Create the process work pool `name` unless it exists (eyas's job template); True when created. An existing
    pool keeps its template, except that its default `stream_output` is turned off (see job_template)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=job_template()))
            return True
        if pool.type != "process":
            raise ValueError(
                f"work pool {name!r} is of type {pool.type!r}, expected 'process'; use --pool for another one"
            )
        template = pool.base_job_template
        stream = template.get("variables", {}).get("properties", {}).get("stream_output")
        if stream is not None and stream.get("default") is not False:
            stream["default"] = False
            client.update_work_pool(name, WorkPoolUpdate(base_job_template=template))
    return False


# What `prefect deploy` does not say: its closing hint names a plain `prefect worker start`, which is not eyas's.
WORKER_HINT = f"""
Start eyas's worker for these deployments, not the plain `prefect worker start` Prefect suggests above:
  process pool {POOL}:   .venv/bin/eyas worker
    (it sets 30-s flow-run heartbeats, durable task results and the crash automation; a plain
    worker has none, so a dead run is never marked Crashed and a resumed one recomputes its stages)
  Kubernetes pool eyas-gpu: .venv/bin/prefect worker start --pool eyas-gpu
    (there the pool's job template sets the same environment in every pod)"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    state_dir = Path(os.environ.get("EYAS_STATE_DIR", REPO / ".eyas"))
    parser.add_argument("--pool", default=POOL, help="process work pool the deployments name")
    parser.add_argument("--results-dir", type=Path, default=state_dir / "results", help="durable task results")
    parser.add_argument(
        "--within-s", type=int, default=None, help=f"seconds without heartbeat before Crashed (default {WITHIN_S})"
    )
    parser.add_argument("--setup-only", action="store_true", help="set up, print the environment, do not start")


def run(args: argparse.Namespace) -> int:
    """Set up the pool and the automation, then become the worker (unless --setup-only)."""
    from eyas_cli.automation import install_crash_detection
    from eyas_cli.server import connect

    api = connect()
    created = ensure_process_pool(args.pool)
    install_crash_detection(args.within_s or crash_window_s())
    env = worker_environment(args.results_dir)
    print(f"work pool {args.pool!r} {'created' if created else 'present'} on {api}; crash detection installed")
    for key, value in env.items():
        print(f"  {key}={value}")
    if args.setup_only:
        return 0
    Path(env["PREFECT_RESULTS_LOCAL_STORAGE_PATH"]).mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", args.pool, "--type", "process"]
    os.execvpe(cmd[0], cmd, {**os.environ, "PREFECT_API_URL": api, **env})
    return 0  # not reached


def deploy(name: str | None, deploy_all: bool) -> int:
    """`prefect deploy` of prefect.yaml's deployments (by name pattern, or all) on eyas's server, from the
    repository; then which worker to start. Returns prefect's exit code."""
    import subprocess

    from eyas_cli.server import connect

    api = connect()
    which = ["--all"] if deploy_all else ["--name", name]
    cmd = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", *which]
    code = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PREFECT_API_URL": api}).returncode
    if code == 0:
        print(WORKER_HINT)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eyas worker", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
