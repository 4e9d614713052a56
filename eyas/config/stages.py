"""The sections of the stages after extraction: the smoke run, the approval gate, export, the benchmark, and
the SGLang environment the engine stages launch."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from eyas.config.base import DType, StrictModel, _refuse_derived_flags, _refuse_renamed


class SmokeConfig(StrictModel):
    num_samples: int = Field(default=8, ge=1, description="samples the smoke run overfits")
    num_steps: int = Field(default=40, ge=2, description="optimizer steps on the same batch")
    lr: float = Field(default=3e-3, gt=0, description="constant learning rate of the smoke run")
    min_loss_drop: float = Field(default=0.3, gt=0, lt=1, description="final loss must be below (1 - this) x first")
    max_cpu_minutes: float = Field(
        default=30,
        gt=0,
        description="a CPU run's smoke run is refused before it starts when its planned cost at this host's measured "
        "speed exceeds this (a GPU run's smoke runs on a training GPU)",
    )


class ApprovalConfig(StrictModel):
    @model_validator(mode="before")
    @classmethod
    def _refuse_removed(cls, data):
        if isinstance(data, dict) and "gpu_hours_per_step" in data:
            raise ValueError(
                "approval.gpu_hours_per_step was removed: the gate's estimate is scaled from the smoke run's "
                "measured speed; delete the key from the preset"
            )
        return data

    timeout_s: int = Field(
        default=7 * 24 * 3600,
        ge=10,
        description="how long the gate waits for a person; then the run fails and nothing is trained",
    )


class ExportConfig(StrictModel):
    format: Literal["sglang", "sglang-0.5.12"] = Field(
        default="sglang",
        description="the export stage's format: sglang = midlayer.* (every SGLang release); sglang-0.5.12 = "
        "layers.{i}.* (SGLang >= 0.5.12; needed for draft.num_layers > 1); eyas remap converts to others",
    )
    checkpoint: Literal["best", "last"] = Field(
        default="best",
        description="which training checkpoint is exported: best = the one the BEST marker names (the highest "
        "estimated acceptance on the held-out split; the newest when train.eval_fraction is 0), last = the newest",
    )
    dtype: DType = Field(default="float32", description="dtype of the exported weights")
    sglang_version: str = Field(
        default="",
        pattern=r"^(\d+\.\d+\.\d+)?$",
        description="the oldest SGLang release the export must run on (e.g. 0.5.23); it decides which draft "
        "variants may be exported (eagle3.1 needs 0.5.12, norm_before_fc 0.5.17); empty = every release the "
        "format serves (0.5.10 on: plain eagle3 only)",
    )


class BenchConfig(StrictModel):
    prompts_path: str = Field(description="held-out prompts JSONL (never the training prompts)")
    num_prompts: int = Field(default=0, ge=0, description="0 = all")
    num_steps: int = Field(default=3, ge=1, description="draft steps: chain length k (topk 1), tree depth (topk > 1)")
    max_new_tokens: int = Field(default=64, ge=1, description="new tokens per held-out prompt at most")
    min_tau: float = Field(default=1.0, ge=0, description="fail the flow when tau_mean is below this")
    engine: Literal["reference", "sglang"] = Field(
        default="reference", description="reference: eyas's loop through hf (CPU or GPU); sglang: a served run (GPU)"
    )
    topk: int = Field(default=1, ge=1, description="1 = chain of `steps`; > 1 = tree (EAGLE-2/3 expansion)")
    num_draft_tokens: int = Field(
        default=0, ge=0, description="tree size as SGLang counts it (root included); 0 = num_steps + 1 (a chain)"
    )
    ngram_max_n: int = Field(default=3, ge=1, description="longest suffix the n-gram baseline looks up")
    diagnose_num_samples: int = Field(default=8, ge=1, description="shard samples for the teacher-forced check")
    min_teacher_forced_accuracy: float = Field(
        default=0.3, ge=0, le=1, description="the diagnosis calls the draft weak below this step-0 accuracy"
    )
    sglang_port: int = Field(default=30000, ge=1, le=65535, description="port of the launched SGLang server")
    sglang_concurrency: int = Field(default=16, ge=1, description="requests in flight against SGLang")
    sglang_startup_timeout_s: int = Field(default=1800, ge=10, description="wait this long for GET /health")
    sglang_extra_args: list[str] = Field(
        default_factory=list,
        description="more launch_server flags, e.g. ['--tp-size', '8', '--mem-fraction-static', '0.8']",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        return _refuse_renamed("bench", data)

    @model_validator(mode="after")
    def _draft_tokens_match_shape(self) -> "BenchConfig":
        _refuse_derived_flags("bench.sglang_extra_args", self.sglang_extra_args)
        if self.topk == 1 and self.num_draft_tokens not in (0, self.num_steps + 1):
            raise ValueError(
                f"bench.num_draft_tokens={self.num_draft_tokens} with bench.topk=1 (a chain of num_steps="
                f"{self.num_steps}): expected 0 or num_steps + 1 = {self.num_steps + 1}"
            )
        if self.topk > 1 and self.num_draft_tokens < 2:
            raise ValueError(
                f"bench.topk={self.topk} (a tree) needs bench.num_draft_tokens >= 2 (root + drafted nodes), "
                f"found {self.num_draft_tokens}"
            )
        return self

    @property
    def draft_tokens(self) -> int:
        """num_draft_tokens with the chain default resolved."""
        return self.num_draft_tokens or self.num_steps + 1


class SGLangEnvConfig(StrictModel):
    """SGLang's own environment, where every server eyas starts runs: regeneration, extraction, the benchmark and
    its baseline (SGLang pins its own torch and transformers; README: A GPU machine)."""

    python: str = Field(
        default="",
        description="the interpreter of SGLang's environment, e.g. /opt/sglang/bin/python, with eyas's capture "
        "module installed there (the eyas-capture wheel: torch and safetensors only); `eyas engine-command` prints "
        "it; empty = the interpreter running eyas (SGLang installed beside eyas)",
    )
    allow_unchecked_versions: list[str] = Field(
        default_factory=list,
        description="SGLang releases to run although eyas has not checked them (checked: 0.5.23), e.g. ['0.5.24']: "
        "the layer each aux id captures, the aux-capture flags, what the capture hook reads and the answers' fields "
        "are then unverified; empty = any other release is refused before its model loads",
    )

    @model_validator(mode="after")
    def _paths_and_versions(self) -> "SGLangEnvConfig":
        if self.python and "/" not in self.python:
            raise ValueError(
                f"sglang.python={self.python!r}: expected the path of SGLang's interpreter (e.g. "
                "/opt/sglang/bin/python), not a name each machine's PATH would resolve to some interpreter; or empty"
            )
        bad = [v for v in self.allow_unchecked_versions if not re.fullmatch(r"\d+\.\d+\.\d+\S*", v)]
        if bad:
            raise ValueError(
                f"sglang.allow_unchecked_versions: {bad} expected release strings as SGLang reports them (e.g. "
                "'0.5.24', '0.5.23.post1')"
            )
        return self
