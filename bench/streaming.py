"""Streaming (extraction and training at once) against extract-then-train on the tiny preset, the producer and
the trainer each pinned to one core.

    .venv/bin/python bench/streaming.py [--num-samples 960 --sample-tokens 256 --num-ttt-steps 2] [--quick]

Data: the tiny preset (deployments/tiny-cpu.json) and its committed target (H 128, float32 shards of 2 KiB a
token); the samples are its prompts' tokenized text cut into samples of `--sample-tokens`/2..`--sample-tokens`
tokens (loss on each one's second half; no regeneration, no network), the draft vocab counted from them. The
draft trains 2 TTT steps, one epoch: its training then costs about the extraction's CPU time, as the goal asks.
The producer is run_streamed_extraction in a process of its own (each shard verified in full as it commits),
in the order the trainer first needs the shards (eyas.train.stream_order); the trainer is `python -m
eyas.train`, one rank, reading through its shard cache (train.cache_bytes `--cache-shards` shards,
train.shuffle_window_shards half as many). Both runs use the same producer, trainer config and order:
  sequential: the producer on core A until every shard is verified, then the trainer on core B;
  streamed:   the producer on core A and, from the same moment, the trainer on core B with TrainJob.stream set.
Figures: `first_step_s` = the streamed trainer's first metric record (stamped as its line arrives) minus the
moment the shards its first step reads were all verified (their verdict files' mtimes), goal <= 10 s;
`streamed_vs_sequential` = wall time from start to both ended, streamed over sequential, goal <= 0.75;
`peak_disk_bytes` = the largest size of the streamed trainer's cache directory, sampled every 20 ms, beside its
bound `disk_bound_bytes` (train.cache_bytes plus the largest shard: one rank); `wait_fraction` = the streamed
trainer's summed data_wait_s over its elapsed_s. Each process's CPU seconds over its wall time (`core_share`)
says whether it had its core alone. The bench refuses to report unless both runs read the same samples at every
step and end with equal final tensors (torch.equal). The last line is one JSON object. `--quick` (for the test
suite): 24 samples of at most 24 tokens, one or two a shard, one epoch: the same code path in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from eyas.config import PlannedShard, RunConfig, StreamSource, TrainJob, load_run_config  # noqa: E402
from eyas.dataset.vocab import ensure_vocab  # noqa: E402
from eyas.extract.plan import describe_extraction  # noqa: E402
from eyas.facts import RunFacts, facts_for  # noqa: E402
from eyas.shards.manifest import read_manifest  # noqa: E402
from eyas.shards.verdicts import VERDICT_NAME_RE, read_verdicts  # noqa: E402
from eyas.train.checkpoint import latest_complete  # noqa: E402
from eyas.train.launch import train_job, write_train_job  # noqa: E402
from eyas.train.metrics import METRICS_FILE, parse_metric_line, read_metrics  # noqa: E402
from eyas.train.stream_order import stream_order  # noqa: E402

PRESET = REPO / "deployments" / "tiny-cpu.json"
TARGET = REPO / "fixtures" / "tiny-target"
SAMPLE_EVERY_S = 0.02  # how often the trainer's cache directory is measured
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


class WeightsDiffer(RuntimeError):
    """The streamed run's final weights are not the sequential run's."""


def write_dataset(workdir: Path, *, num_samples: int, sample_tokens: int, draft_vocab_size: int) -> Path:
    """The tokenized table (RunPaths layout) of the tiny target's prompts, cut into `num_samples` samples of
    sample_tokens/2..sample_tokens tokens, and its vocab mapping; -> the dataset directory."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    with open(TARGET / "prompts.jsonl") as f:
        texts = [json.loads(line)["conversations"][0]["content"] for line in f]
    stream = [t for text in texts for t in tokenizer.encode(text).ids]
    rng, at, samples = random.Random(0), 0, []
    for _ in range(num_samples):
        n = rng.randint(sample_tokens // 2, sample_tokens)
        samples.append([stream[(at + i) % len(stream)] for i in range(n)])
        at += n
    masks = [[int(i >= len(s) // 2) for i in range(len(s))] for s in samples]
    content_hash = f"bench-streaming-{num_samples}-{sample_tokens}"
    table = pa.table({
        "sample_index": pa.array(range(num_samples), pa.int64()),
        "id": pa.array([f"s{i}" for i in range(num_samples)]),
        "input_ids": pa.array(samples, pa.list_(pa.int32())),
        "loss_mask": pa.array(masks, pa.list_(pa.uint8())),
        "num_tokens": pa.array([len(s) for s in samples], pa.int32()),
    }).replace_schema_metadata({b"eyas.content_hash": content_hash.encode()})  # fmt: skip
    out = workdir / "dataset"
    out.mkdir(parents=True)
    pq.write_table(table, out / "tokenized.parquet")
    ids = [t for s in samples for t in s]
    ensure_vocab(out / "vocab.safetensors", ids, [m for mask in masks for m in mask], content_hash,
                 json.loads((TARGET / "config.json").read_text())["vocab_size"], draft_vocab_size)  # fmt: skip
    return out


def run_config(workdir: Path, args: argparse.Namespace) -> RunConfig:
    """The tiny preset at this bench's size, writing under `workdir` (its shards in workdir/shards); validated."""
    data = load_run_config(PRESET).model_dump()
    data["train"].update(num_processes=1, num_epochs=args.num_epochs, global_batch_size=args.global_batch_size,
                         save_every_steps=10_000, shuffle_window_shards=max(1, args.cache_shards // 2),
                         tensorboard=False, num_ttt_steps=args.num_ttt_steps)  # fmt: skip
    data["target"]["model_path"] = str(TARGET)
    data["extract"]["shard_bytes"] = args.shard_kib << 10
    return RunConfig.model_validate({**data, "workdir": str(workdir)})


def run_facts(config: RunConfig) -> RunFacts:
    paths = config.paths
    return facts_for(target_path=config.target.model_path, tokenized_path=paths.tokenized, shards_dir=paths.shards_dir)


def produce(config_path: str) -> None:
    """The producer process: every planned shard extracted and verified, in the trainer's first-need order."""
    from eyas.extract.streamed import run_streamed_extraction

    torch.set_num_threads(1)
    config = RunConfig.model_validate_json(Path(config_path).read_text())
    facts = run_facts(config)
    _, plan = describe_extraction(config.extract, facts, target_dtype=config.target.dtype)
    order = stream_order(plan, config.train).shards
    run_streamed_extraction(config, facts, shard_order=order, target_dtype=config.target.dtype,
                            log=lambda line: print(f"{time.time():.3f} {line}", flush=True))  # fmt: skip


def trainer_job(config: RunConfig, output_dir: Path, *, cache_bytes: int, stream: StreamSource | None) -> TrainJob:
    """The run's trainer job reading its shards through a cache of `cache_bytes`, streamed when `stream` is set."""
    data = train_job(config, run_facts(config), output_dir=output_dir).model_dump()
    data["train"]["cache_bytes"] = cache_bytes
    return TrainJob.model_validate({**data, "stream": stream.model_dump() if stream else None})


class Child:
    """A process pinned to one core; its output to a log file, or read line by line with arrival times. Reaped
    with os.wait4, which gives its CPU seconds: their share of its wall time says whether it had its core alone."""

    def __init__(self, what: str, cmd: list[str], core: int, log: Path, *, follow: bool = False):
        self.what, self.log, self.first_metric_at = what, log, None
        self.ended_at, self.cpu_s = None, 0.0
        env = {**os.environ, **CHILD_ENV}
        out = subprocess.PIPE if follow else open(log, "w")
        self.started_at = time.time()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=lambda: os.sched_setaffinity(0, {core}))  # fmt: skip
        self.reader = threading.Thread(target=self._follow, daemon=True) if follow else None
        if self.reader is not None:
            self.reader.start()
        else:
            out.close()

    def _follow(self) -> None:
        with open(self.log, "w") as f:
            for line in self.proc.stdout:
                if self.first_metric_at is None and parse_metric_line(line) is not None:
                    self.first_metric_at = time.time()
                f.write(line)

    def reap(self, *, block: bool) -> bool:
        """Collect the process if it has ended (waiting for it with `block`); -> whether it has."""
        if self.ended_at is None:
            pid, status, usage = os.wait4(self.proc.pid, 0 if block else os.WNOHANG)
            if pid == 0:
                return False
            self.ended_at, self.cpu_s = time.time(), usage.ru_utime + usage.ru_stime
            self.proc.returncode = os.waitstatus_to_exitcode(status)
            if self.reader is not None:
                self.reader.join()
        return True

    def check(self) -> None:
        """Refuse a failed process, with its log's tail."""
        if self.proc.returncode != 0:
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"{self.what}: exited {self.proc.returncode}; its log {self.log} ends:\n{tail}")

    def figures(self) -> dict:
        wall = self.ended_at - self.started_at
        return {"wall_s": round(wall, 3), "cpu_s": round(self.cpu_s, 3), "core_share": round(self.cpu_s / wall, 3)}


class DiskPeak:
    """The largest total size of the files under a directory, sampled every SAMPLE_EVERY_S in a thread."""

    def __init__(self, root: Path):
        self.root, self.peak, self.done = root, 0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _size(self) -> int:
        total = 0
        for folder, _, files in os.walk(self.root):
            for name in files:
                try:
                    total += os.stat(os.path.join(folder, name)).st_size
                except FileNotFoundError:  # evicted or renamed between the listing and the stat: not on disk
                    pass
        return total

    def _sample(self) -> None:
        while not self.done.wait(SAMPLE_EVERY_S):
            self.peak = max(self.peak, self._size())

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return max(self.peak, self._size())


def start_producer(what: str, config: RunConfig, core: int) -> Child:
    path = Path(config.workdir) / "run.json"
    path.write_text(config.model_dump_json())
    cmd = [sys.executable, str(Path(__file__).resolve()), "--produce", str(path)]
    return Child(what, cmd, core, Path(config.workdir) / "producer.log")


def start_trainer(what: str, job: TrainJob, core: int) -> Child:
    out = Path(job.output_dir)
    out.mkdir(parents=True)
    write_train_job(job, out / "job.json")
    cmd = [sys.executable, "-m", "eyas.train", "--config", str(out / "job.json")]
    return Child(what, cmd, core, out.parent / "train.log", follow=True)


def wait_all(*children: Child) -> None:
    """Wait for every child; the first to fail ends the others (a streamed trainer would wait for its producer
    forever) and is raised, as is anything that interrupts the wait (the children ended first)."""
    try:
        while not all(child.reap(block=False) for child in children):
            time.sleep(0.01)
            if any(c.ended_at is not None and c.proc.returncode != 0 for c in children):
                break
    finally:
        for child in children:
            if child.ended_at is None:  # not reaped yet, so its pid is still its own (Popen.kill would reap it)
                os.kill(child.proc.pid, signal.SIGKILL)
            child.reap(block=True)
    for child in children:
        child.check()


def trainer_figures(output_dir: Path) -> dict:
    """The trainer's metric records summed up: steps, elapsed_s of the last, waited seconds and their share."""
    records = read_metrics(output_dir / METRICS_FILE)
    elapsed, waited = records[-1]["elapsed_s"], sum(r["data_wait_s"] for r in records)
    return {"steps": len(records), "elapsed_s": elapsed, "data_wait_s": round(waited, 3),
            "wait_fraction": round(waited / elapsed, 4), "sample_ids": [r["sample_ids"] for r in records]}  # fmt: skip


def run_sequential(config: RunConfig, cores: tuple[int, int], cache_bytes: int) -> dict:
    """Extraction to the end on cores[0], then the trainer on cores[1] over the finished store."""
    out = Path(config.workdir) / "train"
    producer = start_producer("the sequential run's producer", config, cores[0])
    wait_all(producer)
    job = trainer_job(config, out, cache_bytes=cache_bytes, stream=None)
    trainer = start_trainer("the sequential run's trainer", job, cores[1])
    disk = DiskPeak(out / "shard-cache")
    wait_all(trainer)
    t0 = producer.started_at
    return {"wall_s": trainer.ended_at - t0, "extract_s": producer.ended_at - t0, "train_s": trainer.ended_at - t0,
            "producer": producer.figures(), "trainer": trainer.figures(), "peak_disk_bytes": disk.stop(),
            **trainer_figures(out)}  # fmt: skip


def verified_at(shards_dir: Path, shards: list[int], mode: str) -> float:
    """When the last of `shards` got its verdict of `mode` (the verdict files' mtimes)."""
    times = {}
    for name in read_verdicts(shards_dir):
        match = VERDICT_NAME_RE.match(name)
        if match.group(2) == mode:
            times[int(match.group(1))] = (shards_dir / name).stat().st_mtime
    missing = [k for k in shards if k not in times]
    if missing:
        raise RuntimeError(f"{shards_dir}: no {mode} verdict for shards {missing}, which the first step reads; "
                           f"expected one for every shard of a finished streamed extraction")  # fmt: skip
    return max(times[k] for k in shards)


def run_streamed(config: RunConfig, cores: tuple[int, int], cache_bytes: int) -> dict:
    """The producer on cores[0] and, from the same moment, the streamed trainer on cores[1]."""
    out = Path(config.workdir) / "train"
    _, plan = describe_extraction(config.extract, run_facts(config), target_dtype=config.target.dtype)
    planned = [PlannedShard(sample_start=p.sample_start, sample_end=p.sample_end, num_tokens=p.num_tokens)
               for p in plan]  # fmt: skip
    stream, order = StreamSource(verify_mode=config.verify.mode, plan=planned), stream_order(plan, config.train)
    job = trainer_job(config, out, cache_bytes=cache_bytes, stream=stream)
    producer = start_producer("the streamed run's producer", config, cores[0])
    trainer = start_trainer("the streamed run's trainer", job, cores[1])
    disk = DiskPeak(out / "shard-cache")
    wait_all(producer, trainer)
    needed = order.needed_by(1)
    t0 = producer.started_at
    ready = verified_at(config.paths.shards_dir, needed, config.verify.mode)
    return {"wall_s": max(producer.ended_at, trainer.ended_at) - t0, "extract_s": producer.ended_at - t0,
            "train_s": trainer.ended_at - t0, "producer": producer.figures(), "trainer": trainer.figures(),
            "peak_disk_bytes": disk.stop(), "first_step_shards": needed, "first_step_ready_s": ready - t0,
            "first_step_at_s": trainer.first_metric_at - t0, **trainer_figures(out)}  # fmt: skip


def check_same_training(sequential: Path, streamed: Path, seq: dict, streamed_figs: dict) -> int:
    """The two runs trained on the same samples step by step and their final checkpoints hold equal tensors
    (torch.equal); -> how many tensors were compared. Raises WeightsDiffer naming what differs."""
    if seq["sample_ids"] != streamed_figs["sample_ids"]:
        steps = [k + 1 for k, (a, b) in enumerate(zip(seq["sample_ids"], streamed_figs["sample_ids"])) if a != b]
        raise WeightsDiffer(
            f"{streamed}: the streamed trainer read other samples than the sequential one ({len(seq['sample_ids'])} "
            f"and {len(streamed_figs['sample_ids'])} steps; differing at steps {steps[:10]}); expected the same "
            f"order over the same plan: check train.seed and the stream's plan"
        )
    return equal_tensors(sequential, streamed)


def equal_tensors(a: Path, b: Path) -> int:
    """The final checkpoints under two trainer output dirs hold the same tensors, bit for bit; -> their count."""
    loaded = []
    for out in (a, b):
        final = latest_complete(out)
        if final is None:
            raise WeightsDiffer(f"{out}: no complete checkpoint; expected the trainer's final one")
        loaded.append(
            {f"{f.name}:{k}": v for f in sorted(final.glob("*.safetensors")) for k, v in load_file(f).items()}
        )
    first, second = loaded
    differ = sorted(k for k in first.keys() & second.keys() if not torch.equal(first[k], second[k]))
    only = sorted(first.keys() ^ second.keys())
    if differ or only or not first:
        raise WeightsDiffer(
            f"final weights of {b} differ from {a}: {len(differ)} tensors differ ({differ[:10]}), {len(only)} are "
            f"in one checkpoint only ({only[:10]}), {len(first)} compared; expected every tensor equal (torch.equal): "
            f"a streamed run trains on the same samples in the same order as an offline one; no figure is reported"
        )
    return len(first)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-samples", type=int, default=960)
    p.add_argument("--sample-tokens", type=int, default=256, help="longest sample; lengths spread over [n/2, n]")
    p.add_argument("--shard-kib", type=int, default=4096, help="extract.shard_bytes, in KiB")
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--num-epochs", type=int, default=1)
    p.add_argument("--num-ttt-steps", type=int, default=2, help="train.num_ttt_steps (at the preset's 4, "
                   "training takes about 2.5x the extraction's CPU time)")  # fmt: skip
    p.add_argument("--cache-shards", type=int, default=4, help="train.cache_bytes, in shards of --shard-kib")
    p.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    p.add_argument("--quick", action="store_true", help="24 short samples, 1-2 a shard: seconds, the same code path")
    p.add_argument("--produce", metavar="RUN_JSON", help=argparse.SUPPRESS)  # the producer process's entry
    args = p.parse_args()
    if args.quick:
        args.num_samples, args.sample_tokens, args.shard_kib, args.global_batch_size = 24, 24, 64, 8
        args.num_epochs, args.cache_shards = 1, 2
    return args


def print_table(seq: dict, streamed: dict, figures: dict) -> None:
    print(f"\nshard set: {figures['num_shards']} shards, {figures['shard_set_bytes'] / 2**20:.1f} MiB; trainer: "
          f"{seq['steps']} steps, one rank reading through a cache of {figures['cache_bytes'] / 2**20:.1f} MiB; "
          f"cores {figures['cores']}")  # fmt: skip
    print(f"{'run':11s} {'wall s':>7s} | {'producer: ends s':>16s} {'cpu s':>6s} {'core':>5s} | "
          f"{'trainer: ends s':>15s} {'cpu s':>6s} {'core':>5s} {'waited s':>8s} {'wait':>6s} "
          f"{'peak cache MiB':>14s}")  # fmt: skip
    for name, r in (("sequential", seq), ("streamed", streamed)):
        p, t = r["producer"], r["trainer"]
        print(f"{name:11s} {r['wall_s']:7.1f} | {r['extract_s']:16.1f} {p['cpu_s']:6.1f} {p['core_share']:5.2f} | "
              f"{r['train_s']:15.1f} {t['cpu_s']:6.1f} {t['core_share']:5.2f} {r['data_wait_s']:8.1f} "
              f"{r['wait_fraction']:6.3f} {r['peak_disk_bytes'] / 2**20:14.2f}")  # fmt: skip
    print("(ends: seconds from the run's start; core: the process's CPU seconds over its wall time, 1.00 = its core "
          "to itself)")  # fmt: skip
    print(f"\nfirst step: its shards {streamed['first_step_shards']} verified at {streamed['first_step_ready_s']:.1f} "
          f"s, its record at {streamed['first_step_at_s']:.1f} s: first_step_s {figures['first_step_s']:.2f} "
          f"(goal <= 10)")  # fmt: skip
    print(f"streamed_vs_sequential {figures['streamed_vs_sequential']:.3f} (goal <= 0.75)")
    print(f"peak_disk_bytes {figures['peak_disk_bytes']} against the bound {figures['disk_bound_bytes']} "
          f"(train.cache_bytes + one shard)")  # fmt: skip
    print(f"wait_fraction {figures['wait_fraction']:.3f}; final weights equal: {figures['num_tensors_equal']} tensors")


def figures_of(seq: dict, streamed: dict, rows: list, *, cache_bytes: int, num_equal: int, cores) -> dict:
    """The JSON figures: the four the issue names, the disk bound, and what each process did."""
    sides = {f"{run}_{side}_{key}": r[side][key] for run, r in (("sequential", seq), ("streamed", streamed))
             for side in ("producer", "trainer") for key in ("cpu_s", "core_share")}  # fmt: skip
    return {
        "first_step_s": round(streamed["first_step_at_s"] - streamed["first_step_ready_s"], 3),
        "streamed_vs_sequential": round(streamed["wall_s"] / seq["wall_s"], 4),
        "peak_disk_bytes": streamed["peak_disk_bytes"],
        "disk_bound_bytes": cache_bytes + max(r.num_bytes for r in rows),
        "wait_fraction": streamed["wait_fraction"],
        "weights_equal": True,
        "num_tensors_equal": num_equal,
        "cache_bytes": cache_bytes,
        "num_shards": len(rows),
        "shard_set_bytes": sum(r.num_bytes for r in rows),
        "num_steps": seq["steps"],
        "cores": list(cores),
        **{f"{run}_{key}": round(r[key], 3) for run, r in (("sequential", seq), ("streamed", streamed))
           for key in ("wall_s", "extract_s", "train_s", "data_wait_s", "wait_fraction")},
        "sequential_peak_disk_bytes": seq["peak_disk_bytes"],
        **sides,
    }  # fmt: skip


def main() -> int:
    args = parse_args()
    if args.produce:
        produce(args.produce)
        return 0
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        raise SystemExit(f"bench/streaming.py: this process may run on cores {usable}; expected at least 2, one for "
                         f"the producer and one for the trainer: run it where two cores are free")  # fmt: skip
    cores = (usable[0], usable[1])
    root = Path(tempfile.mkdtemp(prefix="eyas-bench-streaming-", dir=args.dir))
    try:
        runs = {}
        for name in ("sequential", "streamed"):
            config = run_config(root / name, args)
            write_dataset(root / name, num_samples=args.num_samples, sample_tokens=args.sample_tokens,
                          draft_vocab_size=config.dataset.draft_vocab_size)  # fmt: skip
            runs[name] = config
        cache_bytes = args.cache_shards * runs["sequential"].extract.shard_bytes
        seq = run_sequential(runs["sequential"], cores, cache_bytes)
        streamed = run_streamed(runs["streamed"], cores, cache_bytes)
        num_equal = check_same_training(root / "sequential" / "train", root / "streamed" / "train", seq, streamed)
        rows = read_manifest(runs["streamed"].paths.shards_dir)
    finally:
        shutil.rmtree(root)
    figures = figures_of(seq, streamed, rows, cache_bytes=cache_bytes, num_equal=num_equal, cores=cores)
    print_table(seq, streamed, figures)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
