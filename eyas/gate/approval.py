"""Approval records and training overrides: the library side of the approval gate (no Prefect here).

    record = read_approval(config)                 # the decision for this exact configuration, or None
    problems = ignored_overrides(config, {"lr": 1e-3}, num_samples=638)   # [] when every override takes effect
    approved = apply_overrides(config, {"num_epochs": 2})                 # the config the trainer runs

An approval is stored in `{workdir}/approval.json` with the fingerprint of the gated config sections
(`GATE_SECTIONS`) and the overrides the reviewer gave; a re-run of the same configuration reuses it
(and its overrides); a changed configuration asks again. A rejection (or a gate nobody answered in
time) is stored in `{workdir}/rejection.json` the same way, so that `eyas status` can say who
rejected what, when and why; it binds nothing: the next run asks again.
"""

from __future__ import annotations

import json
from pathlib import Path

from eyas.config import RunConfig
from eyas.fsio import atomic_write_text, read_json_record
from eyas.train.checkpoint import latest_complete
from eyas.train.data import total_steps

GATE_SECTIONS = ("target", "dataset", "extract", "draft", "train")
APPROVAL_RECORD = "approval.json"
REJECTION_RECORD = "rejection.json"
# Fields of `train` a reviewer may change at the gate, applied to the training run and recorded.
OVERRIDABLE = ("num_epochs", "lr")


def gate_fingerprint(config: RunConfig) -> str:
    """The fingerprint of the config sections an approval covers."""
    return config.fingerprint(*GATE_SECTIONS)


def read_approval(config: RunConfig) -> dict | None:
    """The recorded approval of this configuration (same gate fingerprint), or None. A record holds approve,
    reviewer, note, overrides, config_fingerprint, decided_at and the flow run that asked."""
    record = read_approval_record(config.paths.root)
    if record is None:
        return None
    if record.get("approve") and record.get("config_fingerprint") == gate_fingerprint(config):
        return record
    return None


def write_approval(config: RunConfig, record: dict) -> None:
    """Record an approval in the workdir (atomically), for `read_approval` to find on a re-run."""
    config.paths.root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(config.paths.root / APPROVAL_RECORD, json.dumps(record, indent=2, sort_keys=True) + "\n")


def apply_overrides(config: RunConfig, overrides: dict) -> RunConfig:
    """The config with `train` fields replaced by the overrides (validated like any config)."""
    unknown = sorted(set(overrides) - set(OVERRIDABLE))
    if unknown:
        raise ValueError(f"overrides {unknown} are not allowed at the gate; expected some of {list(OVERRIDABLE)}")
    if not overrides:
        return config
    data = config.model_dump(mode="json")
    data["train"].update(overrides)
    return RunConfig.model_validate(data)


def ignored_overrides(config: RunConfig, overrides: dict, *, num_samples: int) -> list[str]:
    """Every override that would not change the training run, with the reason and the fix (empty = all take effect)."""
    problems = []
    checkpoint = latest_complete(config.paths.train_dir)
    if "lr" in overrides and checkpoint is not None:
        problems.append(
            f"train.lr={overrides['lr']} would be ignored: training resumes from {checkpoint}, whose optimizer and "
            f"scheduler state carry the learning rate (train.lr={config.train.lr}); leave lr empty, or use a new workdir"
        )
    if "num_epochs" in overrides:
        before = total_steps(num_samples, config.train)
        after = total_steps(num_samples, apply_overrides(config, {"num_epochs": overrides["num_epochs"]}).train)
        if before == after and overrides["num_epochs"] != config.train.num_epochs:
            problems.append(
                f"train.num_epochs={overrides['num_epochs']} would be ignored: train.max_steps={config.train.max_steps} "
                f"ends the run at {after} steps either way; leave num_epochs empty, or change max_steps in the config"
            )
    return problems


def read_approval_record(workdir: str | Path) -> dict | None:
    """The recorded decision of a workdir, whatever configuration it was for (None when there is none)."""
    return read_json_record(Path(workdir) / APPROVAL_RECORD)


def write_rejection(config: RunConfig, record: dict) -> None:
    """Record the newest rejection (or time-out) of a workdir's gate: decision, reviewer, note, decided_at, the
    configuration's fingerprint and the flow run that asked."""
    config.paths.root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(config.paths.root / REJECTION_RECORD, json.dumps(record, indent=2, sort_keys=True) + "\n")


def read_rejection_record(workdir: str | Path) -> dict | None:
    """The newest rejection of a workdir's gate, whatever configuration it was for (None when there is none)."""
    return read_json_record(Path(workdir) / REJECTION_RECORD)
