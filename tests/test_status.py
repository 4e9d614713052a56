"""`eyas status`: the state of a run read from its files (empty, partly extracted, crashed, finished), the
CLI verb, a directory that is no run refused, and the same snapshot as a markdown artifact through a real Prefect
server."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from status_runs import (
    REPO,
    build_finished_run,
    build_partial_run,
    build_trained_run,
    config_at,
    states,
    write_checkpoint_dir,
    write_extract_meta,
    write_metrics,
)

from eyas.config import load_run_config
from eyas.shards.reader import ShardDataError
from eyas.status.report import NotARunError, record_run_config, run_status
from eyas.train.checkpoint_fallback import AllCheckpointsDamagedError
from eyas.train.metrics import last_metrics


def test_an_empty_workdir_has_every_stage_not_started(tmp_path):
    path, config = config_at(tmp_path / "run", tmp_path)
    config.paths.root.mkdir()
    status = run_status(path)
    assert set(states(status).values()) == {"not started"}
    assert status.next_steps()[0].startswith(f"`eyas dataset {path}`")
    assert not any(f["exists"] for f in status.files)
    assert status.software["eyas"] == "0.1.0" and status.hardware["cpus"] == os.cpu_count()


def test_a_partially_extracted_run_names_the_missing_shards(tmp_path):
    path, _ = build_partial_run(tmp_path)
    status = run_status(path)
    assert states(status) == {
        "dataset": "done", "extract": "partial", "verify": "not started", "smoke": "not started",
        "approval": "not started", "train": "not started", "export": "not started", "bench": "not started",
    }  # fmt: skip
    assert status.stage("extract").detail.startswith("4 of 6 shards")
    assert status.progress["shards"] | {"tokens_done": 0, "bytes_done": 0} == {
        "done": 4, "planned": 6, "tokens_done": 0, "bytes_done": 0, "interrupted_writes": 1,
        "quarantined": 0, "last_quarantine_reason": "", "running_here": False,
    }  # fmt: skip
    assert status.next_steps()[0].startswith(f"`eyas extract {path}`: extracts the 2 missing shards of 6")
    assert "1 interrupted writes, removed on resume" in status.to_markdown()


def test_shards_extracted_with_other_parameters_are_stale(tmp_path):
    path, config = build_partial_run(tmp_path)
    write_extract_meta(config, 6, dtype="bfloat16")
    status = run_status(path)
    assert status.stage("extract").state == "stale"
    assert "dtype='bfloat16' there, 'float32' now" in status.stage("extract").detail
    assert status.next_steps()[0].startswith("the shards do not match the config:")


def test_a_workdir_alone_is_read_and_the_commands_say_config(tmp_path):
    _, config = build_partial_run(tmp_path)
    status = run_status(config.paths.root)
    assert status.config is None and status.stage("extract").state == "partial"
    assert status.next_steps()[0].startswith("`eyas extract CONFIG`")
    assert status.next_steps()[-1].startswith(f"no config found for {config.paths.root}")


def test_a_workdir_finds_its_config_in_run_json(tmp_path):
    _, config = build_partial_run(tmp_path)
    recorded = record_run_config(config)
    status = run_status(config.paths.root)
    assert status.config == config and status.config_path == str(recorded)


def test_a_crashed_training_resumes_from_the_newest_complete_checkpoint(tmp_path):
    path, config, ckpt = build_trained_run(tmp_path)
    (config.paths.train_dir / "final.json").unlink()
    (ckpt / "COMPLETE").unlink()  # the crash came during this save
    write_checkpoint_dir(config.paths.train_dir, 20)
    status = run_status(path)
    train = status.stage("train")
    assert train.state == "partial"
    planned = status.progress["train"]["planned_steps"]
    # the preset holds 2 of the 32 samples out (eval_fraction 0.05): 30 // 16 = 1 step an epoch, 30 epochs
    assert int(ckpt.name.removeprefix("step-")) == planned == 30
    assert train.detail.startswith("stopped: newest complete checkpoint step 20 of 30; last logged step 30")
    assert status.next_steps()[0].startswith(f"`eyas train {path}`: resumes from step 20")
    assert status.progress["train"]["incomplete_checkpoints"] == 1


def stopped_at_step_20(tmp_path: Path):
    """A trained run whose last save (step 30) was cut short: the newest complete checkpoint is step 20."""
    path, config, ckpt = build_trained_run(tmp_path)
    (config.paths.train_dir / "final.json").unlink()
    (ckpt / "COMPLETE").unlink()
    write_checkpoint_dir(config.paths.train_dir, 20)
    return path, config


def record_failures(monkeypatch, train_dir: Path, *failures: tuple[int, Exception]) -> None:
    """What the ranks of a 2-process launch leave as each raises (eyas.train.failure.record_failure), in order."""
    from eyas.train.failure import record_failure

    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, exc in failures:
        monkeypatch.setenv("RANK", str(rank))
        try:
            raise exc
        except Exception as raised:
            record_failure(train_dir, raised)


SHARD_FLIP = (
    "shard shard-00003.safetensors: checksum 0123abcd, the manifest says 4567ef01; its bytes changed after "
    "extraction: run eyas verify, which quarantines and re-extracts it"
)


def test_a_failed_training_shows_the_first_failing_rank_as_the_launch_does_and_its_log(tmp_path, monkeypatch):
    from eyas.train.launch import launch_failed

    path, config = stopped_at_step_20(tmp_path)
    train_dir = config.paths.train_dir
    peer = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    record_failures(monkeypatch, train_dir, (1, ShardDataError(SHARD_FLIP)), (0, peer))
    launched = str(launch_failed(1, train_dir, started_from=train_dir / "checkpoints" / "step-00000020"))
    reason = launched.split("; torchrun exited with ")[0]  # what `eyas train` and the flow run said
    assert reason.startswith("training failed on rank 1 of 2 (the first to fail; ")
    assert f"ShardDataError: {SHARD_FLIP} [raised at tests/test_status.py:" in reason
    assert reason.endswith(" in record_failures]; later also rank 0 (RuntimeError)")
    status = run_status(path)
    train, log = status.stage("train"), train_dir / "torchrun.log"
    assert (train.state, train.evidence) == ("failed", "train/failures")
    assert train.detail == f"{reason}; newest complete checkpoint step 20 of 30; the whole log: {log}"
    assert f"| train | failed | {train.detail} | train/failures |" in status.to_markdown()
    assert status.progress["train"]["failure"]["deterministic"] is True


FAILURE_ADVICE = {
    # a deterministic first failure: what to fix, never the same `eyas train` alone
    "shard": (ShardDataError(SHARD_FLIP),
              "`eyas verify CFG` quarantines it and re-extracts it, then `eyas train CFG` resumes from step 20"),
    "nan": (FloatingPointError("step 21: loss nan (per TTT step [nan, nan, nan]); training diverged"),
            "(`eyas verify CFG` with verify.mode=full finds it) or a learning rate too high (lower train.lr in CFG)"),
    "checkpoint": (AllCheckpointsDamagedError("every complete checkpoint is damaged; restore one from a copy"),
                   "a checkpoint could not be used: do what the error says, then `eyas train CFG`"),
    # one another launch may outlive: the re-run, which resumes
    "io": (OSError(5, "Input/output error"),
           "OSError is not a deterministic failure (a lost peer, an I/O error may pass): `eyas train CFG` resumes "
           "from step 20"),
}  # fmt: skip


@pytest.mark.parametrize("fault", sorted(FAILURE_ADVICE))
def test_a_deterministic_training_failure_is_answered_with_its_fix_not_the_same_rerun(tmp_path, monkeypatch, fault):
    path, config = stopped_at_step_20(tmp_path)
    exc, advice = FAILURE_ADVICE[fault]
    record_failures(monkeypatch, config.paths.train_dir, (0, exc))
    status = run_status(path)
    log = config.paths.train_dir / "torchrun.log"
    steps = status.next_steps()
    assert steps[0].startswith(f"training failed: {type(exc).__name__}: {exc} (the whole log: {log}). ")
    assert advice.replace("CFG", str(path)) in steps[0], steps[0]
    alone = f"Re-running `eyas train {path}` alone fails the same way ({type(exc).__name__} is deterministic): "
    assert (alone in steps[0]) is (fault != "io")
    assert not any(step.startswith("`eyas train") for step in steps)


def test_checkpoints_set_aside_as_damaged_are_listed_with_the_file_and_why(tmp_path):
    from eyas.train.checkpoint_fallback import resume_checkpoint
    from eyas.train.checkpoint_verify import RESUME_FILES, TRAINER_STATE_FILE, completion_record, write_marker

    path, config, newest = build_trained_run(tmp_path)
    train_dir = config.paths.train_dir
    for step, ckpt in ((20, write_checkpoint_dir(train_dir, 20)), (30, newest)):
        for name in set(RESUME_FILES) - {TRAINER_STATE_FILE}:
            (ckpt / name).write_bytes(f"{name} of step {step}".encode())
        write_marker(ckpt, completion_record(ckpt, step))
    with open(newest / "optimizer.pt", "r+b") as f:
        f.write(b"O")  # one byte flipped after the checkpoint was completed
    logged = []
    assert resume_checkpoint(train_dir, log=logged.append) == train_dir / "checkpoints" / "step-00000020"
    aside = train_dir / "checkpoints" / "step-00000030.damaged"
    reason = json.loads((aside / "DAMAGED.json").read_text())["reason"]
    assert reason.startswith(f"checkpoint {newest}: optimizer.pt has checksum ")
    status = run_status(path)
    train = status.stage("train")
    assert train.state == "partial"  # final.json names the checkpoint set aside: training resumes from step 20
    assert train.detail == (
        "stopped: newest complete checkpoint step 20 of 30; last logged step 30; a re-run resumes from the "
        f"checkpoint; set aside as damaged (kept for inspection, delete once read): train/checkpoints/"
        f"step-00000030.damaged ({reason})"
    )
    assert [(r["checkpoint"], r["path"]) for r in status.progress["train"]["set_aside"]] == [
        ("step-00000030", str(aside))
    ]
    assert status.next_steps()[0].startswith(f"`eyas train {path}`: resumes from step 20")


def test_a_running_trainer_is_reported_with_its_pid(tmp_path):
    from eyas.train.preflight import process_start_time

    path, config, _ = build_trained_run(tmp_path)
    me = {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "cmd": ["torchrun"], "started_at": "now"}
    (config.paths.train_dir / "processes.json").write_text(json.dumps([me]))
    status = run_status(path)
    assert status.stage("train").state == "running"
    assert f"trainer running (pid {os.getpid()})" in status.stage("train").detail
    assert status.next_steps()[0].startswith(f"training is running: `tail -f {config.paths.train_dir}/torchrun.log`")


def test_an_extraction_holding_the_lock_is_running(tmp_path):
    import fcntl

    path, config = build_partial_run(tmp_path)
    with open(config.paths.shards_dir / ".extract.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held = run_status(path)
    assert held.stage("extract").state == "running"
    assert run_status(path).stage("extract").state == "partial"


def test_a_finished_run_is_done_and_names_its_drafter(tmp_path):
    path, config = build_finished_run(tmp_path)
    status = run_status(path)
    assert set(states(status).values()) == {"done"}, status.stages
    assert status.next_steps()[0].startswith("nothing: the run is finished.")
    assert status.progress["acceptance"]["tau_mean"] == 2.31
    text = status.to_markdown()
    assert "acceptance: tau 2.31 (reference engine), n-gram 1.50, random draft 1.00" in text
    assert f"| exported drafter | {config.paths.export_dir / 'sglang'} | yes |" in text


def mark_best(config, ckpt: Path) -> None:
    """Evaluations that make `ckpt` the best of the complete checkpoints, and the BEST marker the trainer writes
    from them (eyas.train.checkpoint.update_best)."""
    from eyas.train.checkpoint import list_checkpoints, update_best

    for _, path, _ in list_checkpoints(config.paths.train_dir):
        state = json.loads((path / "trainer_state.json").read_text())
        state["eval"] = {"tau_estimate": 2.5 if path == ckpt else 2.0}
        (path / "trainer_state.json").write_text(json.dumps(state))
    assert update_best(config.paths.train_dir)["checkpoint"] == ckpt.name


def export_from(config, ckpt: Path) -> None:
    provenance = config.paths.export_dir / "sglang" / "eyas_export.json"
    provenance.write_text(json.dumps({"source_checkpoint": str(ckpt)}))


def test_an_export_of_the_best_checkpoint_is_done_though_a_newer_one_exists(tmp_path):
    path, config = build_finished_run(tmp_path)
    best = write_checkpoint_dir(config.paths.train_dir, 20)
    mark_best(config, best)
    export_from(config, best)  # what `eyas export` writes with export.checkpoint=best, the default
    status = run_status(path)
    assert status.stage("export").state == "done", status.stage("export")
    assert status.stage("export").detail == (
        "SGLang format from step-00000020, the one BEST names (export.checkpoint=best)"
    )
    assert status.next_steps()[0].startswith("nothing: the run is finished.")


def test_an_export_of_another_checkpoint_than_the_stage_would_choose_is_stale(tmp_path):
    path, config = build_finished_run(tmp_path)
    newest = config.paths.train_dir / "checkpoints" / "step-00000030"
    mark_best(config, write_checkpoint_dir(config.paths.train_dir, 20))
    export_from(config, newest)
    status = run_status(path)
    assert (status.stage("export").state, status.stage("export").detail) == (
        "stale",
        "SGLang format from step-00000030; the export stage exports step-00000020 now, the one BEST names "
        "(export.checkpoint=best)",
    )
    assert status.next_steps()[0].startswith(f"`eyas export {path}`")
    last = config.model_copy(update={"export": config.export.model_copy(update={"checkpoint": "last"})})
    path.write_text(last.model_dump_json())
    assert run_status(path).stage("export").detail == (
        "SGLang format from step-00000030, the newest complete checkpoint (export.checkpoint=last)"
    )
    (config.paths.train_dir / "checkpoints" / "BEST").unlink()
    assert run_status(config.paths.root).stage("export").detail == (  # no config: export.checkpoint's default
        "SGLang format from step-00000030, the newest complete checkpoint, as no BEST marker names one "
        "(export.checkpoint=best, the default: no config found)"
    )


def test_a_directory_that_holds_nothing_of_a_run_is_refused_as_not_a_run(tmp_path, capsys, monkeypatch):
    from eyas_cli.main import main

    (tmp_path / "shards").mkdir()  # a directory of that name alone does not make a run
    (tmp_path / "notes.txt").write_text("not a run")
    expected = (
        f"{tmp_path}: not an eyas run: it holds no run.json (the config a run records beside its outputs), no "
        "launches/ record of an `eyas` command, and none of the files a run's stages write "
        "(dataset/tokenized.parquet, shards/extract.json, train/checkpoints, export/sglang, ...)"
    )
    with pytest.raises(NotARunError) as err:
        run_status(tmp_path)
    assert str(err.value) == (
        f"{expected}; expected a run's workdir (e.g. runs/demo) or its config: `eyas status CONFIG` also reads a run "
        "that has not started"
    )
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert main(["status", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"eyas status: {expected}, and no preset in {REPO / 'deployments'} has it as its workdir; expected a run's "
        "workdir (e.g. runs/demo) or its config: `eyas status CONFIG` also reads a run that has not started\n"
    )
    (tmp_path / "launches").mkdir()  # an `eyas` command started a run here, which died before writing anything
    (tmp_path / "launches" / "eyas-0123abcd.json").write_text(json.dumps({"tag": "eyas-0123abcd", "pid": 1}))
    assert set(states(run_status(tmp_path)).values()) == {"not started"}


def test_an_approval_for_another_configuration_is_stale(tmp_path):
    path, config = build_partial_run(tmp_path)
    record = {"approve": True, "reviewer": "ada", "decided_at": "then", "config_fingerprint": "0" * 16}
    (config.paths.root / "approval.json").write_text(json.dumps(record))
    assert run_status(path).stage("approval").state == "stale"


def test_a_damaged_file_is_reported_and_the_other_stages_still_read(tmp_path):
    path, config = build_finished_run(tmp_path)
    (config.paths.root / "approval.json").write_text('{"approve": tr')
    status = run_status(path)
    assert status.stage("approval").state == "unreadable"
    assert status.stage("approval").detail.startswith(
        f"ValueError: {config.paths.root / 'approval.json'}: not valid JSON"
    )
    assert status.stage("bench").state == "done"


def test_last_metrics_skips_a_line_cut_by_a_crash(tmp_path):
    write_metrics(tmp_path, range(1, 4))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')
    assert last_metrics(tmp_path / "metrics.jsonl")["step"] == 3


def test_the_training_plan_per_device_is_shown_from_the_config_and_its_target(tmp_path, monkeypatch):
    from eyas.target import TargetFacts
    from eyas.train.memory_plan import GIB, run_plan

    monkeypatch.chdir(REPO)  # the preset's target path is relative to the checkout
    path, config = build_partial_run(tmp_path)
    status = run_status(path)
    plan = run_plan(config, TargetFacts.read(config.target.model_path))
    assert status.progress["plan"]["peak_bytes"] == plan.peak_bytes
    assert status.progress["plan"]["micro_batch_tokens"] == plan.micro_batch_tokens
    device_bytes = status.progress["plan"]["device_bytes"]  # this host's available memory then (it moves)
    assert device_bytes > 0
    assert (
        f"- memory plan: fits: peak {plan.peak_bytes / GIB:.1f} GiB per device of {device_bytes / GIB:.1f} GiB"
    ) in status.to_markdown()
    assert (
        f"micro-batches of {plan.micro_batch_tokens:,} tokens (auto: chosen by the memory plan); device budget: this "
        "host's available memory shared by train.num_processes=2"
    ) in status.to_markdown()


def test_a_target_not_readable_here_leaves_the_plan_not_computed_and_the_rest_read(tmp_path):
    path, config = build_partial_run(tmp_path)
    missing = tmp_path / "no-target"
    config = config.model_copy(update={"target": config.target.model_copy(update={"model_path": str(missing)})})
    path.write_text(config.model_dump_json())
    status = run_status(path)
    assert status.stage("extract").state == "partial"
    assert status.progress["plan"]["error"].startswith(f"target.model_path='{missing}': target '{missing}': no config")
    assert "- memory plan: not computed here (target.model_path=" in status.to_markdown()
    assert "`eyas plan CONFIG` where the target's config.json and weight headers are" in status.to_markdown()


def test_the_newest_metric_record_shows_padding_waste_micro_batches_and_peak(tmp_path):
    path, config, _ = build_trained_run(tmp_path)
    record = {"step": 30, "epoch": 29, "loss": 4.2, "lr": 1e-4, "elapsed_s": 61.0, "padding_waste": 0.1234,
              "micro_batches": 3, "peak_memory_bytes": 41 << 30}  # fmt: skip
    with open(config.paths.train_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    text = run_status(path).to_markdown()
    assert (
        "- last metrics: step 30, epoch 29, loss 4.2000, lr 1.00e-04, 61 s into the launch; padding waste 12.3% of "
        "the computed tokens, 3 micro-batches per step (rank 0), measured peak 41.0 GiB per device"
    ) in text
    write_metrics(config.paths.train_dir, range(1, 3))  # records of an older trainer: neither figure
    assert (
        "- last metrics: step 2, epoch 0, loss 8.9800, lr 1.00e-04, 0 s into the launch\n"
        in run_status(path).to_markdown()
    )


def run_cli(*args: str, api_url: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_API_URL": api_url}
    cmd = [sys.executable, "-m", "eyas_cli.main", "status", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=REPO)


def test_status_verb_prints_the_run_without_a_server(tmp_path):
    path, _ = build_partial_run(tmp_path)
    proc = run_cli(str(path), "--json", api_url="http://127.0.0.1:9/api")
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert {s["stage"]: s["state"] for s in printed["stages"]}["extract"] == "partial"
    assert printed["progress"]["shards"]["planned"] == 6
    assert printed["flow_runs_note"].startswith("no Prefect server answers at http://127.0.0.1:9/api")


def test_status_verb_prints_markdown_by_default(tmp_path, capsys, monkeypatch):
    from eyas_cli.main import main

    path, _ = build_partial_run(tmp_path)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert main(["status", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Run `tiny-cpu`") and "| extract | partial | 4 of 6 shards" in out


def test_status_verb_refuses_a_path_that_is_neither_config_nor_workdir(tmp_path, capsys, monkeypatch):
    from eyas_cli.main import main

    monkeypatch.delenv("PREFECT_API_URL", raising=False)  # no server to ask: the path alone is refused
    monkeypatch.setenv("EYAS_STATE_DIR", str(tmp_path / "state"))
    assert main(["status", str(tmp_path / "nowhere")]) == 2
    assert "neither a run config (a JSON RunConfig" in capsys.readouterr().err


@pytest.fixture(scope="module")
def reported_run(prefect_server, tmp_path_factory):
    """A partial run, and a flow run of `export-drafter` (by name) that published its status artifact.
    (No `from __future__ import annotations` in this module: the flow's parameter model needs real types.)"""
    from prefect import flow

    from eyas.config import RunConfig
    from tasks.status import stage_status_artifact

    tmp_path = tmp_path_factory.mktemp("reported")
    path, config = build_partial_run(tmp_path)

    @flow(name="export-drafter")
    def stage_flow(config: RunConfig) -> dict:
        return stage_status_artifact(config, "extract")

    state = stage_flow(config, return_state=True)
    return config, state


def test_stage_status_artifact_publishes_the_snapshot(reported_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    config, state = reported_run
    assert state.is_completed(), state.message
    key = f"status-{config.name}"
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    mine = [a for a in artifacts if a.flow_run_id == state.state_details.flow_run_id]
    assert len(mine) == 1 and mine[0].type == "markdown"
    markdown = mine[0].data
    assert markdown.startswith("# Run `tiny-cpu` (after extract)")
    assert "| extract | partial | 4 of 6 shards" in markdown
    assert "| export-drafter |" in markdown and "| Running |" in markdown  # the flow run itself, as it ran
    assert state.result()["progress"]["shards"]["done"] == 4
    assert load_run_config(config.paths.root / "run.json") == config


def test_status_verb_lists_the_flow_runs_of_the_workdir(reported_run, prefect_server):
    config, state = reported_run
    proc = run_cli(str(config.paths.root), "--json", api_url=prefect_server)
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(proc.stdout)["flow_runs"]
    assert [(r["flow"], r["state"], r["id"]) for r in runs] == [
        ("export-drafter", "Completed", str(state.state_details.flow_run_id))
    ]
