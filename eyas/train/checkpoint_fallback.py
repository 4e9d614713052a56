"""Which checkpoint to load when one may be damaged: each candidate is checked against its completion record
(eyas.train.checkpoint_verify) before anything of it is loaded; a damaged one is set aside (`step-N.damaged`, the
reason in DAMAGED.json, the BEST marker moved off it) and the next candidate is tried, and a log line names the
damaged file and the checkpoint taken instead.

    checkpoint = resume_checkpoint(output_dir, log=print)           # the newest complete one that verifies
    checkpoint = export_choice(output_dir, "best", log=print)       # BEST (or the newest) that verifies

Only complete checkpoints are candidates; None when there is none. When complete checkpoints exist and none of them
verifies, CheckpointError names them all (they are set aside by then, so a re-run starts afresh).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from eyas.train.checkpoint import CHECKPOINTS_DIR, best_checkpoint, latest_complete, read_best, update_best
from eyas.train.checkpoint_verify import (
    ARCH_FILE,
    MODEL_FILE,
    RESUME_FILES,
    TRAINER_STATE_FILE,
    CheckpointDamagedError,
    CheckpointError,
    set_aside,
    unverified_note,
    verify_checkpoint,
)

Log = Callable[[str], None]
EXPORT_FILES = (ARCH_FILE, MODEL_FILE, TRAINER_STATE_FILE)


class AllCheckpointsDamagedError(CheckpointError):
    """Complete checkpoints were found and every one of them is damaged (all set aside now)."""


def choose_verified(
    output_dir: str | Path,
    pick: Callable[[Path], Path | None],
    *,
    files: Iterable[str],
    instead: Callable[[Path], str],
    log: Log,
) -> Path | None:
    """The first checkpoint `pick` names whose `files` verify, setting aside each damaged one it names before;
    `instead(chosen)` ("resuming from step-... instead, ...") ends the line logged for each damaged one."""
    output_dir, files = Path(output_dir), tuple(files)
    damaged: list[tuple[CheckpointDamagedError, Path]] = []
    while (checkpoint := pick(output_dir)) is not None:
        try:
            verified = verify_checkpoint(checkpoint, files)
        except CheckpointDamagedError as err:
            damaged.append((err, set_aside(checkpoint, str(err))))
            update_best(output_dir)  # a BEST marker naming it moves to the best one left (or goes)
            continue
        if not verified:
            log(unverified_note(checkpoint))
        break
    for err, aside in damaged:
        then = instead(checkpoint) if checkpoint is not None else "no complete checkpoint verifies"
        log(
            f"checkpoint {err.checkpoint_dir.name} is damaged: {err.file} {err.problem}; set aside as "
            f"{aside.relative_to(output_dir)} (DAMAGED.json says why); {then}"
        )
    if checkpoint is None and damaged:
        names = ", ".join(err.checkpoint_dir.name for err, _ in damaged)
        raise AllCheckpointsDamagedError(
            f"{output_dir / CHECKPOINTS_DIR}: every complete checkpoint is damaged ({names}); each was set aside as "
            "step-N.damaged with the reason in DAMAGED.json; restore one from a copy, or re-run to start from step 0"
        )
    return checkpoint


def resume_checkpoint(output_dir: str | Path, *, log: Log) -> Path | None:
    """The newest complete checkpoint whose every file verifies (what a resume loads)."""
    return choose_verified(
        output_dir,
        latest_complete,
        files=RESUME_FILES,
        instead=lambda chosen: (
            f"resuming from {chosen.name} instead, the newest older complete checkpoint that verifies"
        ),
        log=log,
    )


def export_choice(output_dir: str | Path, which: str, *, log: Log) -> Path | None:
    """The checkpoint export.checkpoint names (`best`: the one BEST names, the newest without a marker; `last`: the
    newest complete one) whose weights verify; a damaged one is never exported."""
    output_dir = Path(output_dir)

    def best_instead(chosen: Path) -> str:
        marked = read_best(output_dir)
        if marked is not None and marked["checkpoint"] == chosen.name:
            return f"exporting {chosen.name} instead, the best evaluated checkpoint that verifies (BEST names it now)"
        return f"exporting {chosen.name} instead, the newest complete checkpoint that verifies (none evaluated is left)"

    if which == "best":
        return choose_verified(output_dir, best_checkpoint, files=EXPORT_FILES, instead=best_instead, log=log)
    if which == "last":
        return choose_verified(
            output_dir,
            latest_complete,
            files=EXPORT_FILES,
            instead=lambda chosen: (
                f"exporting {chosen.name} instead, the newest older complete checkpoint that verifies"
            ),
            log=log,
        )
    raise ValueError(f"export.checkpoint={which!r}: expected 'best' or 'last'")
