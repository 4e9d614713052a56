"""The training launch: the trainer's job file, the exact torchrun command, and the run of it.

    final = train_run(config, facts, on_metric=callback)    # torchrun -m eyas.train; returns final.json

The trainer is never re-run blindly: every launch resumes from the newest complete checkpoint in
the train directory (eyas.train.trainer) and says which one; a launch that fails raises
TorchrunFailed, whose message is the first failing rank's own exception (eyas.train.failure: the
type, the message, where it was raised) and the log's path, and which records whether it got
further than it started (a newer complete checkpoint) and whether its cause would end the same way
again (`deterministic`), so that a caller relaunches only a trainer that made progress on a failure
another launch could outlive. Every launcher is recorded in the train directory's process registry
(eyas.train.preflight) with its host; `eyas stop` asks every rank of every node to stop at the same step
(eyas.train.nodes), and a stopped launch raises TrainingStopped, which is not relaunched.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

from eyas.config import PlannedShard, RunConfig, StreamSource, TrainConfig, TrainJob
from eyas.facts import RunFacts
from eyas.fsio import atomic_write_text
from eyas.shards.format import extraction_plan
from eyas.train.checkpoint import FINAL_FILE, latest_complete, read_trainer_state
from eyas.train.data import total_steps
from eyas.train.failure import TrainerFailure, clear_failures, describe_failures, first_failure, read_failures
from eyas.train.metrics import MetricsFollower, parse_metric_line
from eyas.train.nodes import clear_stop, raise_if_stopped
from eyas.train.preflight import record_launch

JOB_FILE = "job.json"
LOG_FILE = "torchrun.log"


# A first failure of these kinds is a verdict on the data, the state or the code (a shard that does not match
# its manifest, a non-finite loss, a bad checkpoint): a launch from the same checkpoint meets it again. Any
# other (a collective whose peer died, an OSError, a rank killed by a signal: no record) may pass.
DETERMINISTIC_KINDS = ("ValueError", "ArithmeticError", "LookupError", "TypeError", "AssertionError")


class TorchrunFailed(RuntimeError):
    """torchrun exited non-zero. `failure`: the first failing rank's record (None when no rank left one);
    `progressed`: it left a newer complete checkpoint than it started from; `deterministic`: its cause would
    stop a relaunch the same way."""

    def __init__(
        self,
        message: str,
        *,
        started_from: Path | None,
        newest: Path | None,
        failure: TrainerFailure | None = None,
    ):
        super().__init__(message)
        self.started_from, self.newest, self.failure = started_from, newest, failure

    @property
    def progressed(self) -> bool:
        return self.newest is not None and (self.started_from is None or self.newest.name > self.started_from.name)

    @property
    def deterministic(self) -> bool:
        return self.failure is not None and self.failure.is_a(*DETERMINISTIC_KINDS)


def train_job(config: RunConfig, facts: RunFacts, output_dir: Path | None = None, max_samples: int = 0) -> TrainJob:
    """The trainer's job for this run (the smoke run passes its own output_dir and sample count); with
    train.start='streaming' it carries the shard plan, so that each rank waits for a shard's verdict before reading it
    (eyas.shards.streamed)."""
    paths = config.paths
    cached = config.train.cache_bytes > 0  # read from storage (S3) through each rank's cache
    return TrainJob(
        target_path=str(Path(config.target.model_path).resolve()),
        shards_dir=facts.storage_url if cached else str(Path(facts.shards_dir).resolve()),
        shards_endpoint_url=facts.s3_endpoint_url if cached else "",
        vocab_path=str(paths.vocab.resolve()),
        output_dir=str((output_dir or paths.train_dir).resolve()),
        aux_layer_ids=list(facts.aux_layer_ids),
        draft=config.draft,
        train=config.train,
        max_samples=max_samples,
        chain_steps=config.bench.num_steps,
        stream=stream_source(config, facts) if config.train.start == "streaming" else None,
    )


def stream_source(config: RunConfig, facts: RunFacts) -> StreamSource:
    """What a streamed job reads: the extraction's shard plan (eyas.shards.format.extraction_plan, the one
    eyas.extract.plan.describe_extraction makes), each shard once a verdict of verify.mode names it."""
    plan = extraction_plan(config.extract, facts)
    return StreamSource(
        verify_mode=config.verify.mode,
        plan=[
            PlannedShard(sample_start=p.sample_start, sample_end=p.sample_end, num_tokens=p.num_tokens) for p in plan
        ],
    )


def write_train_job(job: TrainJob, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, job.model_dump_json(indent=2))
    return path


def torchrun_command(config: RunConfig, job_path: Path) -> list[str]:
    """The exact command the train stage runs on this node (torchrun through the current interpreter)."""
    launcher = torchrun_launcher(config.train, rdzv_id=rendezvous_id(config))
    return [*launcher, "-m", "eyas.train", "--config", str(job_path)]


def rendezvous_id(config: RunConfig) -> str:
    """train.rdzv_id, or the run's own: its name and a hash of its workdir, draft and train sections (every node
    launched with the same config derives the same id; another run, or this one changed, another)."""
    return config.train.rdzv_id or f"{config.name}-{config.fingerprint('workdir', 'draft', 'train')[:12]}"


UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # torch.distributed.elastic.rendezvous.dynamic_rendezvous


def torchrun_launcher(train: TrainConfig, *, rdzv_id: str) -> list[str]:
    """torchrun for this node's agent, up to the script it runs.

    train.num_nodes 1: `--standalone` (a rendezvous on a free local port). More (N, or MIN:MAX): torch's elastic
    launcher with the c10d rendezvous at train.rdzv_endpoint, the same command on every node. There is no
    `--node-rank`: torch uses it only for the static rendezvous, and c10d ranks the nodes as they join. The agent
    on the endpoint's host serves the rendezvous store (torch's c10d backend sees the host is one of this
    machine's names or addresses); the others connect to it. `--rdzv-conf` keys are those of torch's
    dynamic_rendezvous.create_handler: join_timeout, last_call_timeout (seconds).

    A node lost while training: the other agents' workers fail in their next collective with it, and each agent
    (SimpleElasticAgent._invoke_run) stops its workers and, while it has `--max-restarts` left, re-runs the
    rendezvous: once the lost node's keep-alive expired (torch's 3 heartbeats of 5 s) the nodes still there form
    the next round, at least MIN of them within join_timeout, and their new workers resume from the newest
    complete checkpoint at the smaller world size. Fewer than MIN: the agents exit non-zero
    (RendezvousTimeoutError, `launch_failed` says so). The agent that hosts the store is the rendezvous itself:
    losing it ends the job on every node.

    The agents run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (through `env`, so that the command a person starts
    on another node carries it): by default (torch 2.13) the workers' process group uses the agent's rendezvous
    store, which node rank 0 keeps from round to round; restarted workers then read their peers' addresses of the
    previous round (gloo: connection refused, in every restart left), and a node joining a running job hangs the
    round (the joining agent waits for a MASTER_ADDR that the agent staying node rank 0 never writes again). With
    it, each round's global rank 0 serves a new store for the workers."""
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    per_node = f"--nproc_per_node={train.num_processes}"
    if train.num_nodes == 1:
        return [*launcher, "--standalone", per_node]
    return [
        "env",
        f"{UNSHARED_STORE}=1",
        *launcher,
        f"--nnodes={train.num_nodes}",
        per_node,
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={train.rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf=join_timeout={train.rdzv_join_timeout_s},last_call_timeout={train.rdzv_last_call_timeout_s}",
        f"--max-restarts={train.max_restarts}",
    ]


def format_command(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


def planned_steps(num_samples: int, config: RunConfig) -> int:
    return total_steps(num_samples, config.train)


def wrap_command(cmd: list[str], width: int = 76, *, split_words: bool = False) -> list[str]:
    """The command as shell lines of at most `width` characters, continued with a backslash; pasted whole, it
    runs as `format_command(cmd)` does. An argument longer than a line gets a line of its own, or with
    `split_words` (for a box that does not indent the lines) is split inside itself: after a `/` where that
    keeps at least half a line, anywhere otherwise. A backslash-newline inside a word joins its pieces again,
    so those continuation lines start at column 0; where the argument needs quoting, each piece is quoted on
    its own (`'/a b/'\\` then `'c d'` is the one argument `/a b/c d`)."""
    lines, line = [], ""
    for arg in cmd:
        word = shlex.quote(arg)
        if line and len(line) + 1 + len(word) + 2 > width:
            lines.append(line + " \\")
            line = "    "
        else:
            line = f"{line} " if line else ""
        while split_words and len(line) + len(word) + 2 > width:
            room = width - 1 - len(line)  # the piece and its backslash
            fits = 0  # the longest head of the argument whose quoted form fits (a quoted form grows with it)
            while fits < len(arg) - 1 and len(shlex.quote(arg[: fits + 1])) <= room:
                fits += 1
            if not fits:
                break
            slash = arg.rfind("/", 0, fits) + 1
            cut = slash if slash > fits // 2 else fits
            lines.append(line + shlex.quote(arg[:cut]) + "\\")
            line, arg = "", arg[cut:]
            word = shlex.quote(arg)
        line += word
    return [*lines, line]


def training_estimate(config: RunConfig, facts: RunFacts, smoke: dict) -> dict:
    """How long the training run will take, scaled from the smoke run's measured tokens/s (one process) to the
    planned steps' tokens on the run's processes: train.num_processes on each of its fewest nodes (linear scaling
    assumed: an optimistic figure when the processes wait on each other, a pessimistic one where warm-up dominated
    the smoke run's steps).

    Returns steps, tokens, tokens_per_s, measured_on, processes, and wall_s / device_hours (None when the smoke
    run measured another kind of device than the one training uses: no figure beats a wrong one)."""
    t = config.train
    steps = planned_steps(facts.num_samples, config)
    per_epoch = sum(min(n, config.draft.max_position_embeddings) for n in facts.sample_lengths())
    used = steps * t.global_batch_size / facts.num_samples  # epochs' worth of samples the steps consume
    tokens = round(per_epoch * used)
    speed, measured_on = smoke.get("tokens_per_s"), smoke.get("device", "cpu")
    trains_on = "cuda" if t.backend == "nccl" else "cpu"
    comparable = bool(speed) and measured_on.split(":")[0] == trains_on
    processes = t.min_world_size
    wall_s = tokens / (speed * processes) if comparable else None
    return {
        "steps": steps,
        "tokens": tokens,
        "tokens_per_s": speed,
        "measured_on": measured_on,
        "trains_on": trains_on,
        "processes": processes,
        "wall_s": wall_s,
        "device_hours": wall_s * processes / 3600 if wall_s is not None else None,
    }


def describe_start(checkpoint: Path | None, config: RunConfig) -> str:
    """Where a launch starts: step 0, or the checkpoint it resumes from (and the copy restored first)."""
    copy = config.train.checkpoint_copy_url
    restore = f" (a newer one in train.checkpoint_copy_url={copy} is restored first)" if copy else ""
    if checkpoint is None:
        return f"no complete checkpoint in {config.paths.train_dir}: training starts at step 0{restore}"
    state = read_trainer_state(checkpoint)
    return f"resuming from {checkpoint} (step {state['step']}, {state['samples_consumed']} samples consumed){restore}"


def finished_run(train_dir: Path, job: TrainJob, last_step: int) -> dict | None:
    """final.json when the same job already trained to its last step and that checkpoint is the newest
    complete one; None when there is training to do (a resume relaunches torchrun)."""
    final_path, job_path = train_dir / FINAL_FILE, train_dir / JOB_FILE
    if not final_path.is_file() or not job_path.is_file():
        return None
    if job_path.read_text() != job.model_dump_json(indent=2):
        return None  # another job (config, shards, target): train it
    final, newest = json.loads(final_path.read_text()), latest_complete(train_dir)
    if (
        newest is None
        or final.get("step") != last_step
        or Path(str(final.get("checkpoint"))).resolve() != newest.resolve()
    ):
        return None
    return final


def train_run(
    config: RunConfig,
    facts: RunFacts,
    *,
    on_metric: Callable[[dict], None] | None = None,
    start_nodes: Callable[[], None] | None = None,
) -> dict:
    """The stage entry: run the trainer under torchrun, resuming from the newest complete checkpoint; every
    rank-0 metric record goes to `on_metric`, every output line to train/torchrun.log. Returns final.json.

    On several nodes this is the first node's agent: `start_nodes` starts the further nodes' agents once the job
    file is written (eyas.train.node_agents), and the metric records come from metrics.jsonl, which global rank 0
    writes on whichever node it is."""
    train_dir = config.paths.train_dir
    job = train_job(config, facts)
    done = finished_run(train_dir, job, planned_steps(facts.num_samples, config))
    if done is not None:
        print(
            f"training already finished at step {done['step']} ({train_dir / FINAL_FILE}, the same job): not relaunched"
        )
        return done
    job_path = write_train_job(job, train_dir / JOB_FILE)
    cmd = torchrun_command(config, job_path)
    started_from = latest_complete(train_dir)
    clear_failures(train_dir)  # the records of an earlier launch
    clear_stop(train_dir)  # a stop asked for before this launch is not for it (eyas.train.nodes)
    print(describe_start(started_from, config))
    print(f"launching: {format_command(cmd)}")
    several = config.train.num_nodes != 1
    if several and start_nodes is not None:
        start_nodes()
    log_path = train_dir / LOG_FILE
    with (
        MetricsFollower(train_dir, on_metric or (lambda record: None)) if several else nullcontext(),
        open(log_path, "a") as log,
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        ) as proc,
    ):
        record_launch(train_dir, proc.pid, cmd)
        for line in proc.stdout:
            log.write(line)
            record = None if several else parse_metric_line(line)
            if record is not None and on_metric is not None:
                on_metric(record)
    raise_if_stopped(train_dir, proc.returncode)  # on `eyas stop`: TrainingStopped, never relaunched
    if proc.returncode != 0:
        raise launch_failed(proc.returncode, train_dir, started_from=started_from)
    clear_failures(train_dir)  # what ranks recorded before torch restarted them (train.max_restarts) is done with
    return json.loads((train_dir / FINAL_FILE).read_text())


def launch_failed(returncode: int, train_dir: Path, *, started_from: Path | None) -> TorchrunFailed:
    """The failure of a launch that exited non-zero: the first failing rank's exception and where it was
    raised, the other ranks that failed, the checkpoints, the log's path; without any rank's record (a rank
    killed by a signal, torchrun itself failing) the log's last lines instead. An agent that gave up on the
    rendezvous (a node lost below MIN, or never started) is named first: the ranks' records then only say
    that their peers went away."""
    log_path, newest = train_dir / LOG_FILE, latest_complete(train_dir)
    checkpoints = (
        f"started from {started_from.name if started_from else 'step 0'}, newest complete checkpoint now "
        f"{newest.name if newest else 'none'}"
    )
    try:
        failures, unreadable = read_failures(train_dir), ""
    except ValueError as e:
        failures, unreadable = [], f" ({e})"
    first = first_failure(failures)
    tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:]) if log_path.is_file() else "(no log)\n"
    rendezvous = f"{rendezvous_timed_out(train_dir, newest)}; " if RENDEZVOUS_TIMEOUT in tail else ""
    if first is None:
        return TorchrunFailed(
            f"{rendezvous}torchrun exited with {returncode} and no rank recorded an exception{unreadable} "
            f"({checkpoints}); last lines of {log_path}:\n{tail}",
            started_from=started_from,
            newest=newest,
        )
    before = "before that, " if rendezvous else ""
    return TorchrunFailed(
        f"{rendezvous}{before}{describe_failures(failures)}; torchrun exited with {returncode} ({checkpoints}); the "
        f"whole log: {log_path}",
        started_from=started_from,
        newest=newest,
        failure=first,
    )


# The last line of torchrun's traceback when an agent's rendezvous could not complete within join_timeout
# (torch.distributed.elastic.rendezvous.dynamic_rendezvous: fewer than MIN nodes joined the round).
RENDEZVOUS_TIMEOUT = "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError"


def rendezvous_timed_out(train_dir: Path, newest: Path | None) -> str:
    """Why a launch whose agent raised RendezvousTimeoutError failed, from the launch's job file: how many nodes
    it needs, how long it waited, and what resumes it."""
    train = TrainJob.model_validate_json((train_dir / JOB_FILE).read_text()).train
    low, _ = train.node_range
    resumes = f"from {newest.name}, the newest complete checkpoint" if newest else "from step 0 (no checkpoint yet)"
    return (
        f"the rendezvous of train.num_nodes={train.num_nodes!r} at {train.rdzv_endpoint} failed: fewer than {low} "
        f"nodes (its MIN) joined within train.rdzv_join_timeout_s={train.rdzv_join_timeout_s} (torch's "
        f"RendezvousTimeoutError: a node was lost and too few were left, or not all were started); start the "
        f"agent of every missing node (the same command and config on each) and retry: training resumes {resumes} "
        f"once {low} nodes are back; or give train.num_nodes a lower MIN ('MIN:MAX') to go on with fewer"
    )
