"""Derived run facts: resolved aux layer ids, the trainer's job file, the torchrun command, estimates."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from eyas.config import RunConfig, TrainJob
from eyas.extract import target_dims
from eyas.fsio import atomic_write_text
from eyas.target import resolve_aux_layer_ids


def target_num_layers(model_path: str | Path) -> int:
    return target_dims(model_path)[0]


def aux_layer_ids(config: RunConfig) -> list[int]:
    return resolve_aux_layer_ids(config.target.aux_layer_ids, target_num_layers(config.target.model_path))


def train_job(config: RunConfig, output_dir: Path | None = None, max_samples: int = 0) -> TrainJob:
    paths = config.paths
    return TrainJob(
        target_path=str(Path(config.target.model_path).resolve()),
        shards_dir=str(paths.shards_dir.resolve()),
        vocab_path=str(paths.vocab.resolve()),
        output_dir=str((output_dir or paths.train_dir).resolve()),
        aux_layer_ids=aux_layer_ids(config),
        draft=config.draft,
        train=config.train,
        max_samples=max_samples,
    )


def write_train_job(job: TrainJob, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, job.model_dump_json(indent=2))
    return path


def torchrun_command(config: RunConfig, job_path: Path) -> list[str]:
    """The exact command the train stage runs (torchrun through the current interpreter)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={config.train.num_processes}",
        "-m",
        "eyas.train",
        "--config",
        str(job_path),
    ]


def format_command(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


def planned_steps(num_samples: int, config: RunConfig) -> int:
    from eyas.train import total_steps

    return total_steps(num_samples, config.train)


def gpu_hours_estimate(num_samples: int, config: RunConfig) -> float:
    return planned_steps(num_samples, config) * config.approval.gpu_hours_per_step * config.train.num_processes
