"""The shapes the checks run at: the Kimi-K2.5 draft of deployments/kimi-k25-8gpu.json on a GPU, or tiny ones
(--quick: the same code paths in seconds, on the CPU too)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from eyas.config import DraftConfig, RunConfig, load_run_config
from eyas.draft import DraftArch
from eyas.shards.encoding import ShardEncoding
from eyas.shards.synthetic import SyntheticSpec
from eyas.target import TargetFacts
from eyas.train.memory_plan import PlanShape

REPO = Path(__file__).resolve().parents[2]
KIMI_PRESET = REPO / "deployments" / "kimi-k25-8gpu.json"
# Kimi-K2.5's text model (config.json): what the preset's draft is built on
KIMI_TARGET = TargetFacts(model_path="Kimi-K2.5", num_layers=61, hidden_size=7168, vocab_size=163840, fingerprint="-")


@lru_cache(maxsize=1)
def kimi_config() -> RunConfig:
    return load_run_config(KIMI_PRESET)


def kimi_plan_shape() -> PlanShape:
    """The preset's training on one device, as eyas plans it (eyas.train.memory_plan.PlanShape.of_run)."""
    return PlanShape.of_run(kimi_config(), KIMI_TARGET, world=1)


def kimi_arch() -> DraftArch:
    """The Kimi preset's draft on Kimi-K2.5: H 7168, 3 aux layers, 163,840 target and 32,000 draft tokens."""
    return kimi_plan_shape().arch


TINY_DRAFT = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
              "max_position_embeddings": 256}  # fmt: skip


@dataclass(frozen=True)
class MemoryPoint:
    batch: int
    length: int
    parallelism: str = "ddp"
    expandable_segments: bool = False

    @property
    def name(self) -> str:
        extra = ", expandable_segments" if self.expandable_segments else ""
        return f"{self.batch}x{self.length} {self.parallelism}{extra}"


@dataclass(frozen=True)
class Sizes:
    """Everything the checks size by: the draft of the memory points, the speed run's data and steps."""

    arch: DraftArch
    encoding: ShardEncoding
    memory_points: tuple[MemoryPoint, ...]
    speed_spec: SyntheticSpec
    speed_draft: DraftConfig
    speed_samples: int
    speed_batch: int
    speed_steps: int  # optimizer steps of the trainer, the first two untimed
    gemm_size: int
    decode_rounds: int
    parity_steps: int


def sizes(quick: bool) -> Sizes:
    if quick:
        arch = DraftArch(hidden_size=64, num_aux=3, target_vocab_size=2048, draft_vocab_size=512, **TINY_DRAFT)
        return Sizes(
            arch=arch,
            encoding=ShardEncoding(),
            memory_points=(MemoryPoint(2, 32, "fsdp2"),),
            speed_spec=SyntheticSpec(hidden=64, num_aux=3, vocab=1024, min_len=48, max_len=64),
            speed_draft=DraftConfig(**TINY_DRAFT),
            speed_samples=12,
            speed_batch=2,
            speed_steps=4,
            gemm_size=256,
            decode_rounds=6,
            parity_steps=2,
        )
    return Sizes(
        arch=kimi_arch(),
        encoding=kimi_plan_shape().encoding,
        memory_points=(
            MemoryPoint(1, 2048),
            MemoryPoint(1, 4096),
            MemoryPoint(2, 4096),
            MemoryPoint(1, 4096, "fsdp2"),
            MemoryPoint(1, 4096, "ddp", expandable_segments=True),
            MemoryPoint(4, 4096),
        ),
        # the draft vocab is the preset's 32,000 (the target's vocab only sizes the frozen embedding: 64,000 here)
        speed_spec=SyntheticSpec(
            hidden=KIMI_TARGET.hidden_size,
            num_aux=3,
            vocab=64000,
            min_len=1536,
            max_len=2048,
            aux_layer_ids=tuple(kimi_config().target.aux_layer_ids),
        ),  # fmt: skip
        speed_draft=kimi_config().draft,
        speed_samples=20,
        speed_batch=2,
        speed_steps=8,
        gemm_size=8192,
        decode_rounds=40,
        parity_steps=4,
    )
