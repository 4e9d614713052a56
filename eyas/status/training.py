"""What `eyas status` says of a training that failed, and of the checkpoints it set aside as damaged, read from
the records the trainer leaves (eyas.train.failure, eyas.train.checkpoint_verify):

    failure = recorded_failure(train_dir)      # the first failing rank's reason, as the launch gave it, or None
    step = failure_step(failure, cfg, resume)  # what to do: fix the cause of a deterministic failure, or re-run
    text = set_aside_text(records, rel)        # "set aside as damaged: checkpoints/step-N.damaged (why)"

A launch removes the records of the one before it, so records in a train directory with no trainer alive are
the last launch's. A failure the launcher does not relaunch (`deterministic`: a ValueError such as a shard that
does not match its manifest, a non-finite loss) meets a re-run of the same command again: the advice is what
to fix, never that re-run alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from eyas.train.failure import describe_failures, read_failures
from eyas.train.launch import DETERMINISTIC_KINDS, LOG_FILE


def recorded_failure(train_dir: Path) -> dict | None:
    """The last launch's failure: `reason` (the launch's own words, eyas.train.failure.describe_failures), `log`,
    the first failing rank's `type`, `kinds` and `message`, and `deterministic` (the launcher does not relaunch
    it); None when no rank recorded one. A record that does not parse raises ValueError naming it."""
    failures = read_failures(train_dir)
    if not failures:
        return None
    first = failures[0]
    return {
        "reason": describe_failures(failures),
        "log": str(Path(train_dir) / LOG_FILE),
        "rank": first.rank,
        "type": first.type,
        "kinds": first.kinds,
        "message": first.message,
        "deterministic": first.is_a(*DETERMINISTIC_KINDS),
    }


def failure_step(failure: dict, cfg: str, resume: str) -> str:
    """The next step after a failed training: what to fix before `eyas train` when the failure is deterministic
    (a shard: `eyas verify`; a non-finite loss: the shards or train.lr; a checkpoint: what the error names),
    else the re-run, which resumes (`resume`: "resumes from step N")."""
    kinds, train = failure["kinds"], f"`eyas train {cfg}`"
    said = f"training failed: {failure['type']}: {failure['message']} (the whole log: {failure['log']})"
    if not failure["deterministic"]:
        return (
            f"{said}. {failure['type']} is not a deterministic failure (a lost peer, an I/O error may pass): {train} "
            f"{resume}; if it fails the same way again, fix what the log names first"
        )
    if "ShardDataError" in kinds:
        fix = (
            f"a shard does not match its manifest: `eyas verify {cfg}` quarantines it and re-extracts it, then "
            f"{train} {resume}"
        )
    elif "FloatingPointError" in kinds:
        fix = (
            f"the loss is not finite: a shard holding non-finite hidden states (`eyas verify {cfg}` with "
            f"verify.mode=full finds it) or a learning rate too high (lower train.lr in {cfg}); then {train} {resume}"
        )
    elif "CheckpointError" in kinds:
        fix = f"a checkpoint could not be used: do what the error says, then {train}"
    else:
        fix = f"fix what the error names (the data, the config or a file it names), then {train} {resume}"
    return f"{said}. Re-running {train} alone fails the same way ({failure['type']} is deterministic): {fix}"


def set_aside_text(records: list[dict], rel: Callable[[Path], str]) -> str:
    """The checkpoints set aside as damaged (eyas.train.checkpoint_verify.read_set_aside's records): where each is
    now and why (the recorded reason names the file that differs)."""
    shown = "; ".join(f"{rel(Path(r['path']))} ({r['reason']})" for r in records)
    return f"set aside as damaged (kept for inspection, delete once read): {shown}"
