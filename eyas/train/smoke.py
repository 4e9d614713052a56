"""The smoke run: overfit a fresh draft on a handful of samples, in this process, before the gate.

    result = smoke_run(config, facts)  # the stage entry: raises SmokeRunFailed when the loss does not fall
    result = smoke_train(job, smoke)   # job: TrainJob, smoke: SmokeConfig

It trains `smoke.num_steps` steps, each on the same batch of the first `smoke.num_samples`
samples, at the constant learning rate `smoke.lr` (no warmup, no decay), and passes when the
mean loss of the last 5 steps is below (1 - `smoke.min_loss_drop`) x the mean of the first 5.
The draft is saved as a normal checkpoint in `job.output_dir` (so it can be exported and
benchmarked) and the result as `job.output_dir/smoke.json`. No process group, no torchrun.
`module_table(draft)` lists every draft module with its parameters and whether it trains.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eyas.config import RunConfig, SmokeConfig, TrainJob
from eyas.draft import Eagle3Draft
from eyas.draft_keys import layer_prefixes
from eyas.facts import RunFacts
from eyas.fsio import atomic_write_text, read_json_record
from eyas.train.checkpoint import TRAINER_STATE_FILE, list_checkpoints, save_checkpoint
from eyas.train.data import collate
from eyas.train.launch import train_job
from eyas.train.step import TTTObjective, make_optimizer, reduce_stats, train_step
from eyas.train.trainer import build_setup

# Rows of the approval gate's module table, in forward order, for a plain single-layer draft (module_rows).
MODULE_ROWS = (
    "embed_tokens",
    "fc",
    "midlayer.input_layernorm",
    "midlayer.hidden_norm",
    "midlayer.self_attn",
    "midlayer.post_attention_layernorm",
    "midlayer.mlp",
    "norm",
    "lm_head",
)


def module_rows(draft: Eagle3Draft) -> tuple[str, ...]:
    """The module table's rows of `draft` in forward order: MODULE_ROWS with the variant's norms before fc and
    the submodules of every decoder layer (a later layer has no input_layernorm)."""
    options = [name for name in ("input_norm", "fc_norm") if hasattr(draft, name)]
    prefixes = layer_prefixes(draft.arch.num_layers)
    layers = [
        f"{prefix}{name}"
        for prefix, layer in zip(prefixes, draft.decoder_layers(), strict=True)
        for name, _ in layer.named_children()
    ]
    return ("embed_tokens", *options, "fc", *layers, "norm", "lm_head")


LOSS_WINDOW = 5
SMOKE_FILE = "smoke.json"


@dataclass
class SmokeResult:
    losses: list[float]
    tokens_per_s: float  # real (unpadded) tokens of the batch over the median step time after the first
    device: str  # where it ran (the estimate at the gate scales this speed)
    first: float  # mean loss of the first LOSS_WINDOW steps
    last: float  # mean loss of the last LOSS_WINDOW steps
    passed: bool
    seconds: float
    checkpoint: str
    modules: list[dict]  # module_table of the trained draft
    num_steps: int
    num_samples: int
    min_loss_drop: float

    def to_dict(self) -> dict:
        return asdict(self)


def module_table(draft: Eagle3Draft) -> list[dict]:
    """One row per draft module: name, parameter count, parameter shapes, trainable (all its params)."""
    modules = dict(draft.named_modules())
    rows, covered = [], set()
    rows_of = module_rows(draft)
    for name in rows_of:
        params = dict(modules[name].named_parameters())
        covered.update(f"{name}.{p}" for p in params)
        rows.append(
            {
                "module": name,
                "num_params": sum(p.numel() for p in params.values()),
                "shapes": {p: list(t.shape) for p, t in params.items()},
                "trainable": all(t.requires_grad for t in params.values()),
            }
        )
    uncovered = sorted(dict(draft.named_parameters()).keys() - covered)
    if uncovered:
        raise ValueError(f"module_table: parameters {uncovered} belong to no row of {rows_of}; add their module")
    return rows


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _clear_previous_smoke(output_dir: Path) -> None:
    """Delete checkpoints of earlier smoke runs (so this one is the newest); refuse real training ones."""
    for _, path, complete in list_checkpoints(output_dir):
        state_file = path / TRAINER_STATE_FILE
        if complete and not json.loads(state_file.read_text()).get("smoke", False):
            raise ValueError(
                f"smoke output_dir {output_dir}: holds training checkpoint {path.name}; the smoke run would mix "
                f"its checkpoint with a real run's; give the smoke run its own output_dir"
            )
        shutil.rmtree(path)


def smoke_train(job: TrainJob, smoke: SmokeConfig) -> SmokeResult:
    """Overfit a fresh draft on the first `smoke.num_samples` samples; see the module docstring."""
    start = time.monotonic()
    output_dir = Path(job.output_dir)
    setup = build_setup(job.model_copy(update={"max_samples": 0}))
    if smoke.num_samples > len(setup.samples):
        raise ValueError(
            f"smoke.num_samples={smoke.num_samples}: the shards hold only {len(setup.samples)} samples; lower it"
        )
    _clear_previous_smoke(output_dir)
    t = job.train
    try:  # with train.cache_bytes the samples come through a shard cache, whose thread ends here
        setup.samples.plan(list(range(smoke.num_samples)))
        samples = [setup.samples.load_sample(i) for i in range(smoke.num_samples)]
    finally:
        setup.samples.close()
    batch = collate(samples, job.draft.max_position_embeddings, min_len=t.num_ttt_steps + 1)
    optimizer = make_optimizer(setup.draft, smoke.lr, t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    objective = TTTObjective(setup.draft, setup.head_rows, t.num_ttt_steps, t.ttt_decay, bf16=False)
    losses, step_s = [], []
    for _ in range(smoke.num_steps):
        step_start = time.perf_counter()
        stats = train_step(objective, optimizer, scheduler, [batch], t.max_grad_norm)
        losses.append(reduce_stats(stats, t.ttt_decay)["loss"])
        step_s.append(time.perf_counter() - step_start)
    window = min(LOSS_WINDOW, smoke.num_steps // 2)
    first, last = _mean(losses[:window]), _mean(losses[-window:])
    trainer_state = {
        "samples_consumed": smoke.num_steps * smoke.num_samples,
        "epoch": 0,
        "world_size": 1,
        "global_batch_size": smoke.num_samples,
        "loss": losses[-1],
        "smoke": True,
    }
    checkpoint = save_checkpoint(
        output_dir,
        smoke.num_steps,
        draft=setup.draft,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state=trainer_state,
        aux_layer_ids=job.aux_layer_ids,
        target_fingerprint=setup.fingerprint,
        keep_last=t.num_checkpoints_kept,
    )
    result = SmokeResult(
        losses=losses,
        tokens_per_s=round(int(batch["valid"].sum()) / statistics.median(step_s[1:] or step_s), 1),
        device="cpu",
        first=first,
        last=last,
        passed=last < (1 - smoke.min_loss_drop) * first,
        seconds=round(time.monotonic() - start, 3),
        checkpoint=str(checkpoint),
        modules=module_table(setup.draft),
        num_steps=smoke.num_steps,
        num_samples=smoke.num_samples,
        min_loss_drop=smoke.min_loss_drop,
    )
    atomic_write_text(output_dir / SMOKE_FILE, json.dumps(result.to_dict(), indent=2) + "\n")
    return result


class SmokeRunFailed(RuntimeError):
    """The smoke run's loss did not fall: the features or the objective are wrong."""


def smoke_run(config: RunConfig, facts: RunFacts) -> SmokeResult:
    """The stage entry: the smoke run of this run's config and shards, in RUN/smoke; refuses a loss that did not
    fall by smoke.min_loss_drop."""
    job = train_job(config, facts, output_dir=config.paths.smoke_dir, max_samples=config.smoke.num_samples)
    result = smoke_train(job, config.smoke)
    if not result.passed:
        s = config.smoke
        raise SmokeRunFailed(
            f"smoke run: loss went {result.first:.3f} -> {result.last:.3f} in {s.num_steps} steps on "
            f"{s.num_samples} samples, expected a drop of at least {s.min_loss_drop:.0%}; "
            f"the features or the objective are wrong: check the shard widths and the vocab mapping"
        )
    return result


def read_smoke_result(smoke_dir: str | Path) -> dict | None:
    """smoke.json of a smoke run (SmokeResult's fields), or None when there was none."""
    return read_json_record(Path(smoke_dir) / SMOKE_FILE)
