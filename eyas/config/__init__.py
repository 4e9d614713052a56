"""The one configuration tree of eyas (strict pydantic: unknown fields are errors).

The flows take `RunConfig` as their parameter (the Prefect UI renders it as a form), the presets
in `deployments/` are JSON instances of it, and the trainer receives a `TrainJob` as one JSON
file. Paths inside a run live under `RunConfig.workdir` and are named by `RunPaths`.

The sections live in eyas.config.sources (target, dataset, extract, verify), eyas.config.train (draft, train) and
eyas.config.stages (smoke, approval, export, bench, sglang); every name is importable from eyas.config.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from eyas.config.base import RENAMED_FIELDS, DType, StrictModel
from eyas.config.sources import (
    DatasetConfig,
    ExtractConfig,
    GenerationConfig,
    SGLangExtractConfig,
    TargetConfig,
    VerifyConfig,
)
from eyas.config.stages import ApprovalConfig, BenchConfig, ExportConfig, SGLangEnvConfig, SmokeConfig
from eyas.config.train import (
    C10D_DEFAULT_PORT,
    DRAFT_VARIANTS,
    DraftConfig,
    TrainConfig,
    check_streaming,
    parse_num_nodes,
    variant_of,
)

__all__ = [
    "C10D_DEFAULT_PORT",
    "DRAFT_VARIANTS",
    "RENAMED_FIELDS",
    "ApprovalConfig",
    "BenchConfig",
    "DType",
    "DatasetConfig",
    "DraftConfig",
    "ExportConfig",
    "ExtractConfig",
    "GenerationConfig",
    "PlannedShard",
    "RunConfig",
    "RunPaths",
    "SGLangEnvConfig",
    "SGLangExtractConfig",
    "SmokeConfig",
    "StreamSource",
    "StrictModel",
    "TargetConfig",
    "TrainConfig",
    "TrainJob",
    "VerifyConfig",
    "load_run_config",
    "parse_num_nodes",
    "variant_of",
]


class RunConfig(StrictModel):
    name: str = Field(
        default="eyas-run", pattern=r"^[a-z0-9][a-z0-9-]*$", description="the run's name (lowercase, digits, '-')"
    )
    workdir: str = Field(description="directory holding every output of the run")
    target: TargetConfig = Field(description="the target LLM the draft is trained for")
    dataset: DatasetConfig = Field(description="prompts, regeneration, tokenization and the draft vocab")
    extract: ExtractConfig = Field(default=ExtractConfig(), description="hidden-state extraction into shards")
    verify: VerifyConfig = Field(default=VerifyConfig(), description="shard verification and healing")
    draft: DraftConfig = Field(default=DraftConfig(), description="the draft's decoder layer")
    train: TrainConfig = Field(default=TrainConfig(), description="the training run under torchrun")
    smoke: SmokeConfig = Field(default=SmokeConfig(), description="the smoke run before the approval gate")
    approval: ApprovalConfig = Field(default=ApprovalConfig(), description="the approval gate")
    export: ExportConfig = Field(default=ExportConfig(), description="the export of the trained draft")
    bench: BenchConfig = Field(description="the acceptance benchmark on held-out prompts")
    sglang: SGLangEnvConfig = Field(
        default=SGLangEnvConfig(), description="SGLang's environment, for every SGLang server eyas starts"
    )

    @model_validator(mode="after")
    def _cache_reads_remote_shards(self) -> "RunConfig":
        if self.train.cache_bytes and not self.extract.storage_url.startswith("s3://"):
            raise ValueError(
                f"train.cache_bytes={self.train.cache_bytes}: the shard cache reads shards stored on S3, and "
                f"extract.storage_url={self.extract.storage_url!r} keeps them in the run's local shards dir already; "
                f"set train.cache_bytes to 0, or extract.storage_url to s3://bucket/prefix"
            )
        return self

    @model_validator(mode="after")
    def _streaming_is_possible(self) -> "RunConfig":
        check_streaming(self.train, self.extract)
        return self

    @model_validator(mode="after")
    def _retention_window_is_single_epoch(self) -> "RunConfig":
        if self.extract.retention != "keep" and self.train.num_epochs != 1:
            raise ValueError(
                f"extract.retention={self.extract.retention} shards releases each shard after its last use, and "
                f"train.num_epochs={self.train.num_epochs} reads every shard again in each epoch; set "
                f"train.num_epochs to 1, or extract.retention to 'keep'"
            )
        if self.extract.retention != "keep" and self.train.start != "streaming":
            raise ValueError(
                f"extract.retention={self.extract.retention} shards bounds the shards a streamed run keeps in storage, "
                f"and train.start={self.train.start!r} extracts every shard before training reads any; set "
                f"train.start to 'streaming', or extract.retention to 'keep'"
            )
        return self

    @property
    def paths(self) -> "RunPaths":
        return RunPaths(Path(self.workdir))

    def fingerprint(self, *parts: str) -> str:
        """Hash of the named config sections (all when none): keys caches and approvals."""
        data = self.model_dump(mode="json")
        chosen = {k: data[k] for k in (parts or sorted(data))}
        return hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:16]


class PlannedShard(StrictModel):
    """One shard of the extraction's plan (eyas.shards.format.ShardPlan), known before it is extracted."""

    sample_start: int = Field(ge=0, description="its first global sample")
    sample_end: int = Field(gt=0, description="one past its last sample")
    num_tokens: int = Field(ge=1, description="tokens it will hold")


class StreamSource(StrictModel):
    """Train while extraction goes on: every planned shard, read only once its verdict names its bytes."""

    verify_mode: Literal["cheap", "full"] = Field(
        description="verify.mode: the verdict a shard needs before it is read"
    )
    plan: list[PlannedShard] = Field(min_length=1, description="the shard plan, shard 0 first (describe_extraction)")

    @model_validator(mode="after")
    def _plan_is_contiguous(self) -> "StreamSource":
        end = 0
        for k, p in enumerate(self.plan):
            if p.sample_start != end or p.sample_end <= p.sample_start:
                raise ValueError(
                    f"stream.plan[{k}]: samples {p.sample_start}..{p.sample_end}, expected a non-empty range from "
                    f"sample {end}; pass the shard plan of eyas.extract.plan.describe_extraction whole, in order"
                )
            end = p.sample_end
        return self


class TrainJob(StrictModel):
    """Everything `python -m eyas.train --config job.json` needs, written by the train task."""

    target_path: str = Field(description="the target's model directory")
    shards_dir: str = Field(
        description="the shard set to train on: a local directory; with train.cache_bytes > 0 also s3://bucket/prefix, "
        "read through the cache"
    )
    shards_endpoint_url: str = Field(default="", description="S3 API endpoint of an s3:// shards_dir; empty = AWS")
    vocab_path: str = Field(description="the draft vocab mapping (vocab.safetensors)")
    output_dir: str = Field(description="checkpoints, metrics.jsonl and final.json go here")
    aux_layer_ids: list[int] = Field(description="canonical aux layer ids the shards were extracted at")
    draft: DraftConfig = Field(description="the draft's decoder layer")
    train: TrainConfig = Field(description="the training run")
    max_samples: int = Field(default=0, ge=0, description="use the first N samples; 0 = all")
    chain_steps: int = Field(
        default=3, ge=1, description="bench.num_steps: the draft chain the held-out evaluation estimates tau for"
    )
    stream: StreamSource | None = Field(
        default=None,
        description="set: train while extraction goes on (sample index from the plan, each shard waited for until "
        "verified); unset: train on the finished manifest",
    )

    @model_validator(mode="after")
    def _remote_shards_need_a_cache(self) -> "TrainJob":
        if "://" in self.shards_dir and not self.train.cache_bytes:
            raise ValueError(
                f"shards_dir={self.shards_dir!r} with train.cache_bytes=0: a storage URL is read through the shard "
                f"cache; set train.cache_bytes, or point shards_dir at a local copy"
            )
        return self


class RunPaths:
    """Where each stage writes inside a run's workdir."""

    def __init__(self, root: Path):
        self.root = Path(root)

    @property
    def dataset_dir(self) -> Path:
        return self.root / "dataset"

    @property
    def tokenized(self) -> Path:
        return self.dataset_dir / "tokenized.parquet"

    @property
    def vocab(self) -> Path:
        return self.dataset_dir / "vocab.safetensors"

    @property
    def shards_dir(self) -> Path:
        return self.root / "shards"

    @property
    def verify_report(self) -> Path:
        return self.root / "verify" / "report.parquet"

    @property
    def smoke_dir(self) -> Path:
        return self.root / "smoke"

    @property
    def train_dir(self) -> Path:
        return self.root / "train"

    @property
    def export_dir(self) -> Path:
        return self.root / "export"

    @property
    def bench_dir(self) -> Path:
        return self.root / "bench"


def load_run_config(path: str | Path) -> RunConfig:
    """Read a preset (JSON) into a RunConfig. Relative paths inside it are kept as written: they are relative to
    the directory the command runs in (the repo root, for the bundled presets)."""
    return RunConfig.model_validate_json(Path(path).read_text())
