"""Durable training checkpoints: `output_dir/checkpoints/step-00001234/`.

Each checkpoint is written into a temporary sibling directory, every file fsynced, the directory
renamed into place and fsynced, and only then the `COMPLETE` marker written (atomically), holding the
checksum and size of every file (eyas.train.checkpoint_verify). A directory without the marker is never
loaded: a crash at any instant leaves either the previous complete checkpoint or the new one. Every
reader checks the files it reads against the marker first; a damaged checkpoint raises
CheckpointDamagedError naming the file (eyas.train.checkpoint_fallback falls back to an older one, and a
BEST marker naming a checkpoint that is gone or set aside moves to the best one left). The state is always
the full (unsharded) one, written by rank 0, whether the run used DDP or FSDP2 (eyas.train.parallel): a
checkpoint resumes under either, on any world size. Contents:

  model.safetensors    the full draft state dict (embed_tokens, d2t, t2d included)
  arch.json            {"arch": DraftArch.to_dict(), "aux_layer_ids", "layer_id_convention",
                        "target_fingerprint"}; the exporter reads this and model.safetensors
  optimizer.pt         optimizer.state_dict() of an unsharded draft (integer parameter ids)
  scheduler.pt         lr scheduler state_dict()
  rng.pt               torch (and CUDA) RNG states
  trainer_state.json   {"step", "samples_consumed", "epoch", "world_size", ..., "eval"}
  COMPLETE             written last: {"step", "files": {NAME: {"checksum", "bytes"}}}

`checkpoints/BEST` names the complete checkpoint with the highest estimated acceptance on the held-out split
(trainer_state "eval"."tau_estimate", eyas.train.evaluate; a tie goes to the later step):
{"checkpoint": "step-00000200", "step": 200, "tau_estimate": 2.41}. `update_best` writes it atomically after
every checkpoint, before rotation, and again when a run resumes (a kill -9 between a checkpoint and its
marker update is mended then, from the checkpoints' own trainer_state); rotation never deletes the checkpoint
it names. A run without held-out evaluation has no marker, and `best_checkpoint` is then the newest.

Everything is read back with `torch.load(..., weights_only=True)` and strict key checks; this module
is the only reader of a checkpoint directory (`read_checkpoint` for the export, `load_draft` and
`load_training_state` for the trainer, `train_state` for eyas status, with the checkpoints set aside).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eyas.draft import DraftArch, Eagle3Draft
from eyas.draft_keys import KeyCheckError, check_key_set, expected_eyas_shapes
from eyas.fsio import TMP_MARKER, atomic_write_text, checked_safetensors_header, replace_dir, temp_path
from eyas.layer_ids import LAYER_ID_CONVENTION
from eyas.train.checkpoint_verify import (
    ARCH_FILE,
    COMPLETE_MARKER,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RESUME_FILES,
    RNG_FILE,
    SCHEDULER_FILE,
    TRAINER_STATE_FILE,
    CheckpointError,
    completion_record,
    read_set_aside,
    require_complete,
    require_verified,
    write_marker,
)
from eyas.train.parallel import full_model_state, full_optimizer_state, load_full_model_state, load_full_optimizer_state

CHECKPOINTS_DIR = "checkpoints"
FINAL_FILE = "final.json"
BEST_MARKER = "BEST"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path, bool]]:
    """(step, dir, complete) for every `step-NNNNNNNN` dir, by step; temporary dirs are skipped."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child, (child / COMPLETE_MARKER).is_file()))
    return sorted(found)


def latest_complete(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None when there is none."""
    complete = [path for _, path, done in list_checkpoints(output_dir) if done]
    return complete[-1] if complete else None


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    draft: Eagle3Draft,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    trainer_state: dict,
    aux_layer_ids: list[int],
    target_fingerprint: str,
    keep_last: int,
) -> Path:
    """Write step `step` of an unsharded draft (one process, or rank 0 of DDP); see `write_checkpoint`."""
    return write_checkpoint(
        output_dir,
        step,
        model_state=full_model_state(draft),
        optimizer_state=full_optimizer_state(draft, optimizer),
        scheduler_state=scheduler.state_dict(),
        arch=draft.arch,
        trainer_state=trainer_state,
        aux_layer_ids=aux_layer_ids,
        target_fingerprint=target_fingerprint,
        keep_last=keep_last,
    )


def arch_record(arch: DraftArch, aux_layer_ids: list[int], target_fingerprint: str) -> dict:
    """The contents of arch.json (read back by `read_arch`)."""
    return {
        "arch": arch.to_dict(),
        "aux_layer_ids": list(aux_layer_ids),
        "layer_id_convention": LAYER_ID_CONVENTION,
        "target_fingerprint": target_fingerprint,
    }


def write_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict,
    scheduler_state: dict,
    arch: DraftArch,
    trainer_state: dict,
    aux_layer_ids: list[int],
    target_fingerprint: str,
    keep_last: int,
) -> Path:
    """Write step `step` durably from full (unsharded, CPU) state dicts, then keep only the newest
    `keep_last`; see the module docstring. Rank 0 alone calls it."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    temp = temp_path(final)
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    save_file(model_state, temp / MODEL_FILE, metadata={"format": "eyas"})
    _write_json(temp / ARCH_FILE, arch_record(arch, aux_layer_ids, target_fingerprint))
    torch.save(optimizer_state, temp / OPTIMIZER_FILE)
    torch.save(scheduler_state, temp / SCHEDULER_FILE)
    torch.save(rng_state(), temp / RNG_FILE)
    _write_json(temp / TRAINER_STATE_FILE, {**trainer_state, "step": step})
    commit_step_dir(temp, final, completion_record(temp, step))
    update_best(output_dir)
    rotate_checkpoints(output_dir, keep_last)
    return final


def commit_step_dir(temp: Path, final: Path, marker: dict | str) -> None:
    """Put the finished `temp` in place of `final` (eyas.fsio.replace_dir: an incomplete dir left by a crash,
    or a step being re-saved, is replaced), then write the COMPLETE marker (the completion record)."""
    replace_dir(temp, final)
    write_marker(final, marker)


def _tau_of(checkpoint_dir: Path) -> float | None:
    evaluated = read_trainer_state(checkpoint_dir).get("eval") or {}
    return evaluated.get("tau_estimate")


def read_best(output_dir: str | Path) -> dict | None:
    """The BEST marker's record, or None when there is none."""
    path = Path(output_dir) / CHECKPOINTS_DIR / BEST_MARKER
    return json.loads(path.read_text()) if path.is_file() else None


def update_best(output_dir: str | Path) -> dict | None:
    """Point BEST at the best evaluated checkpoint among the one it names and every complete one on disk;
    returns the marker's record (None when no checkpoint was evaluated: a marker naming a checkpoint that is gone,
    one set aside as damaged, is deleted)."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    candidates = [
        (tau, step, path.name)
        for step, path, done in list_checkpoints(output_dir)
        if done
        for tau in [_tau_of(path)]
        if tau is not None
    ]
    marked = read_best(output_dir)
    if marked is not None and (root / marked["checkpoint"] / COMPLETE_MARKER).is_file():
        candidates.append((marked["tau_estimate"], marked["step"], marked["checkpoint"]))
    if not candidates:
        if marked is not None:
            (root / BEST_MARKER).unlink()
        return None
    tau, step, name = max(candidates)
    record = {"checkpoint": name, "step": step, "tau_estimate": tau}
    if record != marked:
        atomic_write_text(root / BEST_MARKER, json.dumps(record, sort_keys=True) + "\n")
    return record


def best_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint BEST names (complete, checked), else the newest complete one; None when there is none."""
    marked = read_best(output_dir)
    if marked is None:
        return latest_complete(output_dir)
    path = Path(output_dir) / CHECKPOINTS_DIR / marked["checkpoint"]
    require_complete(path)
    return path


def rotate_checkpoints(output_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints and the one BEST names, plus older incomplete
    and temp dirs."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: expected at least 1 (the newest checkpoint is never deleted)")
    entries = list_checkpoints(output_dir)
    complete = [(step, path) for step, path, done in entries if done]
    keep = {path for _, path in complete[-keep_last:]}
    best = read_best(output_dir)
    if best is not None:
        keep.add(Path(output_dir) / CHECKPOINTS_DIR / best["checkpoint"])
    newest = complete[-1][0] if complete else -1
    doomed = [path for step, path, done in entries if path not in keep and (done or step < newest)]
    root = Path(output_dir) / CHECKPOINTS_DIR
    doomed += [p for p in root.iterdir() if TMP_MARKER in p.name] if root.is_dir() else []
    for path in doomed:  # step dirs, and the temporaries of a killed write: dirs, or the BEST marker's file
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return doomed


def read_arch(checkpoint_dir: str | Path) -> dict:
    """arch.json of a checkpoint, checked: `arch` (as a DraftArch, every field), aux_layer_ids (one per aux
    layer), layer_id_convention (the canonical one) and target_fingerprint."""
    path = Path(checkpoint_dir) / ARCH_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {checkpoint_dir}: no {ARCH_FILE}; expected a training checkpoint")
    meta = json.loads(path.read_text())
    convention = meta.get("layer_id_convention")
    if convention != LAYER_ID_CONVENTION:
        raise CheckpointError(
            f"checkpoint {path}: layer_id_convention {convention!r}, expected {LAYER_ID_CONVENTION!r}; "
            "eyas checkpoints store HF hidden_states indices; convert the ids before exporting"
        )
    try:
        meta["arch"] = DraftArch.from_dict(meta.get("arch", {}), where=f"checkpoint {path}")
    except ValueError as err:
        raise CheckpointError(str(err)) from err
    ids = list(meta.get("aux_layer_ids", []))
    if len(ids) != meta["arch"].num_aux:
        raise CheckpointError(
            f"checkpoint {path}: aux_layer_ids={ids} has {len(ids)} ids, expected arch.num_aux="
            f"{meta['arch'].num_aux}; the checkpoint metadata is inconsistent: re-save it from training"
        )
    meta["aux_layer_ids"] = ids
    meta.setdefault("target_fingerprint", "")
    return meta


def _checked_state(checkpoint_dir: Path, arch: DraftArch, *, embed_optional: bool = False) -> dict[str, torch.Tensor]:
    """model.safetensors, its key set and shapes exactly the eyas draft's (embed_tokens may be absent where a
    conversion from a format that drops it is being read)."""
    path = checkpoint_dir / MODEL_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {checkpoint_dir}: no {MODEL_FILE}; expected a training checkpoint")
    checked_safetensors_header(path)
    state = load_file(path)
    expected = expected_eyas_shapes(arch)
    if embed_optional and "embed_tokens.weight" not in state:
        expected.pop("embed_tokens.weight")
    try:
        check_key_set(
            {k: tuple(v.shape) for k, v in state.items()},
            expected,
            where=f"checkpoint {path} (eyas format)",
        )
    except KeyCheckError as err:
        raise CheckpointError(str(err)) from err
    return state


@dataclass
class DraftCheckpoint:
    """A draft in the eyas form: eyas state-dict keys (embed_tokens.weight may be absent), canonical layer ids."""

    path: Path
    arch: DraftArch
    aux_layer_ids: list[int]
    target_fingerprint: str
    state: dict[str, torch.Tensor]


def read_checkpoint(checkpoint_dir: str | Path, *, log: Callable[[str], None] = print) -> DraftCheckpoint:
    """A complete checkpoint's draft as tensors (what the exporter converts), every file checked (its checksum
    against the completion record first)."""
    checkpoint_dir = Path(checkpoint_dir)
    require_verified(checkpoint_dir, (ARCH_FILE, MODEL_FILE), log)
    meta = read_arch(checkpoint_dir)
    state = _checked_state(checkpoint_dir, meta["arch"], embed_optional=True)
    return DraftCheckpoint(checkpoint_dir, meta["arch"], meta["aux_layer_ids"], str(meta["target_fingerprint"]), state)


def load_model_state(draft: Eagle3Draft, checkpoint_dir: str | Path) -> None:
    """Load model.safetensors into `draft` (sharded or not): every key and shape must match, else one
    sorted error."""
    load_full_model_state(draft, _checked_state(Path(checkpoint_dir), draft.arch))


def load_draft(checkpoint_dir: str | Path, *, log: Callable[[str], None] = print) -> tuple[Eagle3Draft, dict]:
    """A complete checkpoint's draft (embeddings frozen) and its arch.json (+ trainer_state), checksums checked."""
    checkpoint_dir = Path(checkpoint_dir)
    require_verified(checkpoint_dir, (ARCH_FILE, MODEL_FILE, TRAINER_STATE_FILE), log)
    meta = read_arch(checkpoint_dir)
    draft = Eagle3Draft(meta["arch"])
    load_model_state(draft, checkpoint_dir)
    draft.freeze_embeddings()
    meta["trainer_state"] = read_trainer_state(checkpoint_dir)
    return draft, meta


def read_trainer_state(checkpoint_dir: str | Path) -> dict:
    """trainer_state.json of a checkpoint ({"step", "samples_consumed", "epoch", "world_size", ...})."""
    return json.loads((Path(checkpoint_dir) / TRAINER_STATE_FILE).read_text())


def load_training_state(
    checkpoint_dir: str | Path,
    *,
    draft: Eagle3Draft,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    verified: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """Restore model, optimizer, scheduler and RNG from a complete checkpoint; returns trainer_state.

    Every rank calls it with its own (DDP replica or FSDP2-sharded) draft and the optimizer over it. Every file is
    checked against the completion record first, unless the caller just did (`verified`)."""
    checkpoint_dir = Path(checkpoint_dir)
    if verified:
        require_complete(checkpoint_dir)
    else:
        require_verified(checkpoint_dir, RESUME_FILES, log)
    saved = read_arch(checkpoint_dir)["arch"]
    if saved != draft.arch:
        raise CheckpointError(
            f"checkpoint {checkpoint_dir}: trained with arch {saved.to_dict()}, the job builds "
            f"{draft.arch.to_dict()}; resume with the same draft config or use a new output_dir"
        )
    load_model_state(draft, checkpoint_dir)
    optimizer_state = torch.load(checkpoint_dir / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    load_full_optimizer_state(draft, optimizer, optimizer_state)
    scheduler.load_state_dict(torch.load(checkpoint_dir / SCHEDULER_FILE, map_location="cpu", weights_only=True))
    set_rng_state(torch.load(checkpoint_dir / RNG_FILE, map_location="cpu", weights_only=True))
    return read_trainer_state(checkpoint_dir)


@dataclass
class TrainState:
    """What a train directory holds now (for eyas status)."""

    latest: Path | None  # the newest complete checkpoint
    trainer_state: dict | None  # its trainer_state.json
    num_incomplete: int  # step dirs without COMPLETE (a crash during a save)
    final: dict | None  # final.json, written when the run reached its last step
    set_aside: list[dict]  # damaged checkpoints set aside: DAMAGED.json records ("checkpoint", "reason", "path")


def train_state(output_dir: str | Path) -> TrainState:
    """The checkpoints and final.json of a train directory, read without loading any tensor."""
    output_dir = Path(output_dir)
    entries = list_checkpoints(output_dir)
    latest = latest_complete(output_dir)
    final_path = output_dir / FINAL_FILE
    return TrainState(
        latest=latest,
        trainer_state=read_trainer_state(latest) if latest is not None else None,
        num_incomplete=sum(1 for _, _, done in entries if not done),
        final=json.loads(final_path.read_text()) if final_path.is_file() else None,
        set_aside=read_set_aside(output_dir / CHECKPOINTS_DIR),
    )
