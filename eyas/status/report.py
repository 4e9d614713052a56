"""Where a run stands, read from the durable files of its workdir alone: what `eyas status RUN` prints.

    from eyas.status.report import run_status
    status = run_status("runs/demo")          # a workdir, a RunConfig JSON, or a RunConfig
    print(status.to_markdown())               # stages, progress, next command, software, hardware, files

Each stage's state comes from what that stage leaves when it is done (eyas.status.probes asks each
file's owner), never from a log:

    dataset    dataset/tokenized.parquet + dataset/vocab.safetensors (+ report.json)
    extract    shards/extract.json (shards planned) + the manifest's rows (shards done)
    verify     verify/report.parquet against the manifest (a shard extracted later is unverified)
    smoke      smoke/smoke.json
    approval   approval.json, for this configuration's fingerprint
    train      train/checkpoints/step-*/COMPLETE, final.json, metrics.jsonl, the trainer PIDs eyas recorded,
               train/failures/ (why the last launch failed), checkpoints/step-*.damaged (set aside)
    streaming  train/job.json with `stream`: both sides of a streamed run (eyas.status.stream: shards extracted and
               verified, the trainer's step and shards, its lead and waits, train/waits/)
    export     export/sglang/ (+ eyas_export.json naming the checkpoint it came from)
    bench      bench/benchmark.json, bench/diagnosis.json

A RUN given as a directory is matched with its config through `run.json` (written by each stage's status
artifact, tasks/status.py) or a preset in `presets_dir` whose workdir is that directory; without one the
stages are still read and the commands say CONFIG, unless the directory holds nothing of a run (no launch
record, none of the files above): that is refused (NotARunError) rather than reported as a run not started. Nothing here imports Prefect: the flow runs a server
knows of are added by the caller (`RunStatus.flow_runs`, see tasks/status.py). With a config, the training's
memory plan per device is computed from it and the target's facts (eyas.status.progress; `eyas plan` in full).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from eyas.config import RunConfig, load_run_config
from eyas.fsio import atomic_write_text
from eyas.gate.approval import GATE_SECTIONS
from eyas.markdown import table
from eyas.status import probes
from eyas.status.launches import ALIVE, ELSEWHERE, GONE, LAUNCHES_DIR, launch_of, liveness, read_launches
from eyas.status.probes import DONE, FAILED, REJECTED, RUNNING, STALE, UNREADABLE
from eyas.status.progress import progress_lines, training_plan
from eyas.status.stream import stream_progress
from eyas.status.training import failure_step
from eyas.train.devices import DeviceQueryFailed, query_devices

RUN_CONFIG_NAME = probes.RUN_CONFIG_NAME
STAGES = ("dataset", "extract", "verify", "smoke", "approval", "train", "export", "bench")
SOFTWARE = ("eyas", "torch", "transformers", "prefect", "safetensors", "sglang")
# Prefect state names of a flow run that has not ended and is not waiting at the gate.
IN_FLIGHT = ("Running", "Pending", "Scheduled", "Late", "AwaitingRetry", "Retrying", "Cancelling")
WAITING = ("Paused", "Suspended")
SHOWN_RUNS = 10  # flow runs in the markdown table (the advice reads all of them)
# The eyas verb that runs each flow (tasks/status.py's FLOW_NAMES), for the advice to re-run one.
VERBS = {
    "pipeline": "run",
    "build-dataset": "dataset",
    "extract-hidden-states": "extract",
    "extract-worker": "extract",
    "verify-shards": "verify",
    "train-drafter": "train",
    "export-drafter": "export",
    "benchmark-acceptance": "bench",
}


@dataclass
class StageState:
    stage: str
    state: str  # one of eyas.status.probes.STATES
    detail: str
    evidence: str  # the file (relative to the workdir) the state was read from


@dataclass
class RunStatus:
    workdir: str
    config_path: str | None
    config: RunConfig | None
    stages: list[StageState]
    progress: dict
    files: list[dict]
    software: dict
    hardware: dict
    flow_runs: list[dict] = field(default_factory=list)  # filled by the caller from a Prefect server
    flow_runs_note: str = ""  # why there are none: no server answered (then nothing in flight could be checked)

    def attach_flow_runs(self, runs: list[dict], note: str = "") -> None:
        """The flow runs a server knows for this workdir (tasks/status.py), each run by an `eyas` command's own
        process annotated with that process: `process` alive | gone | elsewhere, `pid`, `host`."""
        launches = read_launches(self.workdir)
        for run in runs:
            launch = launch_of(run, launches)
            if launch is not None:
                run |= {"process": liveness(launch), "pid": launch.get("pid"), "host": launch.get("host")}
        self.flow_runs, self.flow_runs_note = runs, note

    def stage(self, name: str) -> StageState:
        return next(s for s in self.stages if s.stage == name)

    def next_steps(self) -> list[str]:
        return next_steps(self)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["config"] = None if self.config is None else self.config.model_dump(mode="json")
        return {**data, "next_steps": self.next_steps()}

    def to_markdown(self, title: str = "") -> str:
        return render_markdown(self, title)


def resolve_run(run: "str | Path | RunConfig", presets_dir: Path | None = None):
    """(workdir, config or None, config path or None) of a workdir, a RunConfig JSON, or a RunConfig."""
    if isinstance(run, RunConfig):
        return Path(run.workdir), run, None
    path = Path(run)
    if path.is_file():
        config = load_run_config(path)
        return Path(config.workdir), config, path
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path}: neither a run config (a JSON RunConfig, e.g. deployments/tiny-cpu.json) nor a run's workdir "
            f"(e.g. runs/demo); pass one of those"
        )
    if (path / RUN_CONFIG_NAME).is_file():
        return path, load_run_config(path / RUN_CONFIG_NAME), path / RUN_CONFIG_NAME
    for preset in sorted(presets_dir.glob("*.json")) if presets_dir else []:
        config = load_run_config(preset)
        if Path(config.workdir).resolve() == path.resolve():
            return path, config, preset
    if not probes.run_evidence(path):
        presets = f", and no preset in {presets_dir} has it as its workdir" if presets_dir else ""
        raise NotARunError(
            f"{path}: not an eyas run: it holds no {RUN_CONFIG_NAME} (the config a run records beside its outputs), "
            f"no {LAUNCHES_DIR}/ record of an `eyas` command, and none of the files a run's stages write "
            f"({', '.join(probes.EVIDENCE_EXAMPLES)}, ...){presets}; expected a run's workdir (e.g. runs/demo) or its "
            "config: `eyas status CONFIG` also reads a run that has not started"
        )
    return path, None, None


class NotARunError(ValueError):
    """A directory given as a run's workdir that holds nothing of a run."""


def record_run_config(config: RunConfig) -> Path:
    """Write the config beside the run's outputs (`run.json`), so that `eyas status WORKDIR` finds it."""
    path = config.paths.root / RUN_CONFIG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, config.model_dump_json(indent=2) + "\n")
    return path


def run_status(run: "str | Path | RunConfig", *, presets_dir: Path | None = None) -> RunStatus:
    """The status of a run from its files; see the module docstring."""
    workdir, config, config_path = resolve_run(run, presets_dir)
    ctx = probes.Context(workdir=workdir, config=config)
    stages = []
    for name in STAGES:
        try:
            stages.append(StageState(name, *getattr(probes, f"probe_{name}")(ctx)))
        except probes.READ_ERRORS as err:  # a damaged file is this stage's state, not a crash of the report
            stages.append(StageState(name, UNREADABLE, f"{type(err).__name__}: {err}", ""))
    if config is not None:
        ctx.progress["plan"] = training_plan(config)
    if (streamed := stream_progress(ctx.paths.train_dir)) is not None:
        ctx.progress["stream"] = streamed
    return RunStatus(
        workdir=str(workdir),
        config_path=None if config_path is None else str(config_path),
        config=config,
        stages=stages,
        progress=ctx.progress,
        files=probes.file_table(ctx),
        software=software_versions(),
        hardware=hardware(),
    )


def software_versions() -> dict:
    """Installed versions (of this environment, which need not be the one that ran the stages)."""
    versions = {"python": platform.python_version()}
    for name in SOFTWARE:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def hardware() -> dict:
    """This machine: host, CPU count, and the GPUs torch sees (CUDA_VISIBLE_DEVICES applied), asked in a short
    subprocess (eyas.train.devices) where an NVIDIA driver is installed."""
    gpus = []
    if shutil.which("nvidia-smi"):
        try:
            found = query_devices()
        except DeviceQueryFailed as err:
            gpus = [f"the device query failed: {err}"]
        else:
            gpus = [_gpu_line(row) for row in found["devices"]] or [found.get("unavailable_reason") or "none visible"]
    return {"host": socket.gethostname(), "cpus": os.cpu_count(), "gpus": ", ".join(gpus) or "none visible"}


def _gpu_line(row: dict) -> str:
    used, total = row.get("memory_used_mib"), row.get("memory_total_mib")
    memory = f"{used}/{total} MiB used" if used is not None else "memory not readable"
    return f"{row['device']} {row.get('name', '')} ({memory})"


def stage_command(stage: StageState, cfg: str, run: str, status: RunStatus) -> str:
    """The command that moves `stage` forward, with why."""
    name, state, detail = stage.stage, stage.state, stage.detail
    whole = f"(or `eyas run {cfg}`: the whole pipeline from here)"
    if name == "dataset":
        return f"`eyas dataset {cfg}`: regenerate, tokenize and build the vocab mapping {whole}"
    if name == "extract" and state == STALE:
        return f"the shards do not match the config: {detail}; then `eyas extract {cfg}`"
    if name == "extract":
        shards = status.progress.get("shards", {})
        todo = (
            f"the {shards['planned'] - shards['done']:,} missing shards of {shards['planned']:,}"
            if shards
            else "every shard"
        )
        return f"`eyas extract {cfg}`: extracts {todo}; finished shards are kept {whole}"
    if name == "verify" and state == FAILED:
        return f"`eyas verify {cfg}`: quarantines the bad shards, re-extracts and verifies them again"
    if name == "verify":
        return f"`eyas verify {cfg}` {whole}"
    if name == "smoke" and state == FAILED:
        return f"the smoke run's loss did not fall ({detail}): check the shards (`eyas verify {cfg}`) and the vocab, then `eyas train {cfg}`"
    if name in ("smoke", "approval"):
        return f"`eyas train {cfg}`: smoke run, the approval gate (UI, or `eyas approve RUN_ID`), then training {whole}"
    if name == "train":
        step = status.progress.get("train", {}).get("step")
        where = f"resumes from step {step:,}" if step else "starts from step 0"
        if state == FAILED:
            return failure_step(status.progress["train"]["failure"], cfg, where)
        return f"`eyas train {cfg}`: {where} (an approval recorded for this configuration is not asked again) {whole}"
    if name == "export":
        return f"`eyas export {cfg}` {whole}"
    if state == FAILED:
        return f"read {run}/bench/diagnosis.json ({detail}); fix the cause, then `eyas bench {cfg}`"
    return f"`eyas bench {cfg}`"


def _where(run: dict) -> str:
    if run.get("process") in (ALIVE, ELSEWHERE):
        return f"in the `eyas` process {run['pid']} on {run['host']}"
    return "through a deployment (its worker runs it)" if run.get("deployment") else "in a process eyas did not record"


def _rerun(run: dict, cfg: str) -> str:
    return f"`eyas {VERBS.get(run['flow'], 'run')} {cfg}`"


def flight_steps(status: RunStatus, cfg: str) -> tuple[list[str], bool]:
    """Advice from the flow runs the server knows: (steps, whether they settle what to do now, so that no
    stage command is added beside them). Decided on the top-level runs (a pipeline, or a stage verb's flow);
    their subflows say where a live one is now."""
    runs = status.flow_runs
    if not runs:
        note = status.flow_runs_note
        return ([f"could not check for runs in flight or waiting at the gate: {note}"] if note else []), False
    tops = [r for r in runs if not r.get("subflow")]
    dead = [r for r in tops if r["state"] in IN_FLIGHT + WAITING and r.get("process") == GONE]
    waiting = [r for r in tops if r["state"] in WAITING and r.get("process") != GONE]
    live = [r for r in tops if r["state"] in IN_FLIGHT and r.get("process") != GONE]
    if dead:
        top = dead[0]
        return [
            f"flow run {top['id']} ({top['flow']}) is {top['state']} on the server, but the `eyas` process that ran "
            f"it ({top['pid']} on {top['host']}) is gone: it died without reporting. The crash automation marks it "
            "Crashed one window after its last heartbeat (EYAS_CRASH_WITHIN_S, 90 s by default); no need to wait: "
            f"{_rerun(top, cfg)} resumes from what is durable (finished stages come back from cache or their files)"
        ], True
    if waiting:
        run = waiting[0]
        return [
            f"flow run {run['id']} ({run['flow']}) waits at the approval gate: read the summary in the UI (Resume), "
            f"then `eyas approve {run['id']}` or `eyas approve {run['id']} --reject --note WHY`"
        ], True
    if live:
        top = live[0]
        inner = [r for r in runs if r.get("subflow") and r["state"] in IN_FLIGHT + WAITING]
        now = f", now in {inner[0]['flow']} ({inner[0]['run']})" if inner else ""
        return [
            f"flow run {top['id']} ({top['flow']}) is {top['state']} {_where(top)}{now}: wait for it; `eyas status` "
            "again shows its progress"
        ], True
    if tops and tops[0]["state"] == "Crashed":
        newest = tops[0]
        retry = (
            f"`.venv/bin/prefect flow-run retry {newest['id']}` (its deployment's worker runs it again)"
            if newest.get("deployment")
            else _rerun(newest, cfg)
        )
        return [
            f"flow run {newest['id']} ({newest['flow']}) Crashed ({newest.get('message') or 'no message'}): retry "
            f"it with {retry}; finished stages come back from cache or their files, training from its newest "
            "checkpoint"
        ], True
    return [], False


def rejection_step(status: RunStatus, cfg: str) -> str:
    rejection = status.progress["rejection"]
    what = (
        "nobody answered the gate in time (approval.timeout_s)"
        if rejection["decision"] == "timed out"
        else f"{rejection['reviewer']} rejected training at {rejection['decided_at']}: "
        f'"{rejection.get("note") or "no note"}"'
    )
    return (
        f"{what}. Change what the note asks for in {cfg} (the gate covers its sections {', '.join(GATE_SECTIONS)}), "
        f"then `eyas run {cfg}`: finished stages come back, and the gate asks again"
    )


def next_steps(status: RunStatus) -> list[str]:
    """What to do now, first the command to run."""
    cfg, run = status.config_path or "CONFIG", status.workdir
    steps, settled = flight_steps(status, cfg)
    if settled:
        return steps
    if status.stage("train").state == RUNNING:
        return steps + [
            f"training is running: `tail -f {run}/train/torchrun.log`; `eyas status` again later; stop it with `eyas stop {run}/train`"
        ]
    if status.stage("extract").state == RUNNING:
        return steps + ["an extraction is running on this machine: `eyas status` again shows its progress"]
    # the smoke run and the gate matter only before training: once approved, or once trained, they are passed
    passed = {"smoke"} if status.stage("approval").state == DONE else set()
    passed |= {"smoke", "approval"} if status.stage("train").state == DONE else set()
    pending = [s for s in status.stages if s.state != DONE and s.stage not in passed]
    if pending and pending[0].stage == "approval" and pending[0].state == REJECTED:
        steps.append(rejection_step(status, cfg))
    elif pending:
        steps.append(stage_command(pending[0], cfg, run, status))
    else:
        steps.append(
            f"nothing: the run is finished. The drafter is {run}/export/sglang; serve it with `python -m "
            f"sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {run}/export/sglang ...` (see README, Acceptance benchmark)"
        )
    if status.config is None:
        steps.append(
            f"no config found for {run}: `eyas status CONFIG` gives exact commands and checks the files against it"
        )
    return steps


def _table(header: list[str], rows: list[list]) -> list[str]:
    return table(header, rows).split("\n")


def render_markdown(status: RunStatus, title: str = "") -> str:
    name = status.config.name if status.config else Path(status.workdir).name
    out = [f"# Run `{name}`{f' ({title})' if title else ''}", ""]
    out += [f"workdir `{status.workdir}`; config `{status.config_path or 'not found'}`", "", "## Stages", ""]
    out += _table(
        ["stage", "state", "detail", "read from"], [[s.stage, s.state, s.detail, s.evidence] for s in status.stages]
    )
    out += ["", "## Progress", ""] + [f"- {line}" for line in progress_lines(status.progress, status.config)]
    out += ["", "## Next", ""] + [f"{i}. {step}" for i, step in enumerate(status.next_steps(), 1)]
    out += ["", "## Prefect flow runs of this workdir", ""]
    if status.flow_runs:
        keys = ["flow", "run", "state", "process", "started", "duration_s", "id"]
        shown = status.flow_runs[:SHOWN_RUNS]
        rows = [[r.get(k, "") for k in keys] for r in shown]
        for row, r in zip(rows, shown):
            row[3] = f"{r['pid']} on {r['host']}: {r['process']}" if r.get("process") else "-"
            if r.get("process") == GONE and r["state"] in IN_FLIGHT + WAITING:
                row[2] = f"{r['state']} on the server; its process is gone"
        out += _table(keys, rows)
        if len(status.flow_runs) > SHOWN_RUNS:
            out += ["", f"and {len(status.flow_runs) - SHOWN_RUNS} older (`--json` lists them)"]
    out += [status.flow_runs_note] if status.flow_runs_note else ([] if status.flow_runs else ["none recorded"])
    out += ["", "## Software and hardware (this machine)", ""]
    out += _table(["", ""], [[k, v] for k, v in {**status.software, **status.hardware}.items()])
    out += ["", "## Files", ""]
    out += _table(["what", "path", "exists"], [[f["what"], f["path"], _exists(f["exists"])] for f in status.files])
    return "\n".join(out) + "\n"


def _exists(flag: bool | None) -> str:
    return "remote" if flag is None else ("yes" if flag else "-")


def format_json(status: RunStatus) -> str:
    return json.dumps(status.to_dict(), indent=2, default=str)


__all__ = ["NotARunError", "RunStatus", "StageState", "STAGES", "record_run_config", "resolve_run", "run_status"]
