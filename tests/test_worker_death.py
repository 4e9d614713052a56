"""A worker that dies alone (an OOM kill, a restart) does not take its flow runs with it.

On a real server and a real process worker of eyas's pool (eyas_cli.worker.ensure_process_pool: `stream_output`
off, so a flow run's stdout is no pipe to the worker), one pipeline run goes through untouched, then two more
of the same configuration, each in its own workdir, have only their worker SIGKILLed: one while the trainer
runs, one while the benchmark runs, a new worker started after each kill. The flow-run processes survive the
kill, keep beating (the crash automation never marks them Crashed), and finish Completed with the same trained
weights and the same benchmark as the untouched run.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from machine import alive, process_tree, start_time, start_worker
from run_fixtures import small_run_config
from run_queries import answer_when_waiting, client, drain_run_logs, read_run, wait_for
from safetensors.torch import load_file

from eyas.export.convert import SGLANG_EXPORT
from eyas.train.checkpoint import latest_complete
from eyas.train.data import total_steps

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
POOL = "worker-death"
WITHIN_S = 60  # the automation's window: a run that stopped beating would be Crashed within the test
BENCH_FIGURES = (
    "tau_mean",
    "tau_per_prompt",
    "accept_rate_per_position",
    "num_verify_steps",
    "tau_random",
    "tau_ngram",
    "lossless",
)


def small_config(workdir: Path, tiny: Path):
    return small_run_config(
        workdir,
        tiny,
        extract={"batch_size": 1},
        train={"num_epochs": 12, "global_batch_size": 4, "save_every_steps": 5, "num_warmup_steps": 2},
        smoke={"num_samples": 2, "num_steps": 30},
        approval={"timeout_s": 900},
        bench={
            "prompts_path": str(tiny / "heldout_prompts.jsonl"),
            "num_prompts": 6,
            "max_new_tokens": 32,
            "min_tau": 0.0,
        },
    )


def flow_run_processes(worker_pid: int) -> dict[int, str]:
    """The processes under the worker ({pid: start time}), without the worker itself."""
    return {pid: s for pid in process_tree(worker_pid) - {worker_pid} if (s := start_time(pid))}


@pytest.fixture(scope="module")
def scenario(prefect_server, tmp_path_factory, tiny_target_dir):
    from prefect import flow
    from prefect.deployments import run_deployment

    from eyas_cli.automation import install_crash_detection
    from eyas_cli.worker import ensure_process_pool, worker_environment

    root = tmp_path_factory.mktemp("worker-death")
    env = {**os.environ, "PREFECT_API_URL": prefect_server, **worker_environment(root / "results")}
    ensure_process_pool(POOL)
    automation_id = install_crash_detection(within_s=WITHIN_S)
    flow.from_source(source=str(REPO), entrypoint="flows/pipeline.py:pipeline").deploy(
        name=POOL, work_pool_name=POOL, build=False, push=False, print_next_steps=False
    )
    workers, obs = [], {"kills": []}

    def new_worker():
        workers.append(start_worker(POOL, env, root / f"worker-{len(workers)}.log", REPO))

    def run_through(config, kill_when: list[tuple[str, callable]]):
        run_id = run_deployment(f"pipeline/{POOL}", parameters={"config": config.model_dump(mode="json")}, timeout=0).id
        thread, _ = answer_when_waiting(
            lambda: read_run(run_id), [{"approve": True, "reviewer": "worker-death"}], timeout_s=600
        )
        for label, ready in kill_when:
            wait_for(ready, 900, label, 0.05)
            worker = workers[-1]
            runs = flow_run_processes(worker.pid)
            os.kill(worker.pid, signal.SIGKILL)  # the worker alone
            worker.wait()
            time.sleep(2)  # a run that died with it would be gone by now (it prints every step)
            obs["kills"].append({"while": label, "under_worker": runs, "alive_after": alive(runs)})
            new_worker()
        wait_for(lambda: read_run(run_id).state.is_final(), 900, "the run to finish")
        thread.join(timeout=5)
        return run_id

    try:
        new_worker()
        reference = small_config(root / "reference", tiny_target_dir)
        obs["reference"] = (reference, run_through(reference, []))
        for name, stage in (("killed-training", "training"), ("killed-benchmark", "benchmarking")):
            config = small_config(root / name, tiny_target_dir)
            train_dir, bench_file = config.paths.train_dir, config.paths.bench_dir / "benchmark.json"
            exported = config.paths.export_dir / SGLANG_EXPORT / "config.json"
            ready = {
                "training": lambda: (c := latest_complete(train_dir)) is not None and c.name >= "step-00000010",
                "benchmarking": lambda: exported.is_file() and not bench_file.exists(),
            }[stage]
            obs[name] = (config, run_through(config, [(stage, ready)]))
        drain_run_logs()
        yield obs
    finally:
        for worker in workers:
            if worker.poll() is None:
                for pid in process_tree(worker.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                worker.wait()
        from prefect.automations import Automation

        Automation.read(id=automation_id).delete()
        drain_run_logs()


def state_names(run_id) -> list[str]:
    with client() as c:
        return [s.name for s in c.read_flow_run_states(run_id)]


def test_the_runs_outlive_their_worker(scenario):
    assert [k["while"] for k in scenario["kills"]] == ["training", "benchmarking"]
    for kill in scenario["kills"]:
        assert kill["under_worker"], f"no flow-run process under the worker while {kill['while']}"
        assert kill["alive_after"] == set(kill["under_worker"]), kill  # none died with the worker
    config = scenario["killed-training"][0]
    trained = json.loads((config.paths.train_dir / "final.json").read_text())
    # 32 samples, 2 held out: 7 steps an epoch, 84 in all; the kill came at checkpoint 10: training went on past it
    assert total_steps(32, config.train) == 84 and trained["step"] == 84


def test_the_interrupted_run_completes_and_is_never_marked_crashed(scenario):
    for name in ("reference", "killed-training", "killed-benchmark"):
        _, run_id = scenario[name]
        assert read_run(run_id).state.name == "Completed", (name, read_run(run_id).state.message)
        assert "Crashed" not in state_names(run_id), state_names(run_id)


def test_the_interrupted_runs_trained_and_measured_what_the_untouched_one_did(scenario):
    runs = [scenario[name][0] for name in ("reference", "killed-training", "killed-benchmark")]
    weights = [load_file(str(c.paths.export_dir / SGLANG_EXPORT / "model.safetensors")) for c in runs]
    bench = [json.loads((c.paths.bench_dir / "benchmark.json").read_text()) for c in runs]
    for other in (1, 2):
        assert weights[0].keys() == weights[other].keys()
        for key in weights[0]:
            assert torch.equal(weights[0][key], weights[other][key]), key
        for figure in BENCH_FIGURES:
            assert bench[0].get(figure) == bench[other].get(figure), (
                figure,
                bench[0].get(figure),
                bench[other].get(figure),
            )
    assert bench[0]["num_prompts"] == 6
