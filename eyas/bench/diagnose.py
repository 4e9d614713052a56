"""Why is tau low? A report of checks, each passed or failed, over the known causes.

    from eyas.bench.diagnose import diagnose
    report = diagnose(export_dir="run/export/sglang", shards_dir="run/shards", target_path="target/",
                      tau=1.02, launch_argv=None)
    print(report.to_markdown())

Checks (see "Facts from the field" in the architecture notes): shard widths (n_aux * H, not H:
the fc bypass), the export's key set, d2t present with valid offsets, an explicit
draft_vocab_size, the layer-id convention (export vs shards), the launch flags (SGLang only) and
the draft's teacher-forced accuracy on verified shards. When that accuracy is high but tau is
about 1.0 the draft is fine and the serving side is wrong; when it is low, the draft itself is.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from eyas.bench.sglang import lint_launch_command
from eyas.config import RunConfig
from eyas.dataset.vocab import check_vocab_mapping
from eyas.draft import DraftArch
from eyas.export.configs import read_config
from eyas.export.drafter_dir import read_export_provenance
from eyas.export.keys import check_keys, expected_shapes
from eyas.export.reader import load_exported_draft
from eyas.export.serving import SGLANG_FORMAT_SINCE
from eyas.facts import shard_source
from eyas.fsio import atomic_write_text, read_json_record
from eyas.layer_ids import LAYER_ID_CONVENTION, from_engine_layer_ids, sglang_convention, target_layout
from eyas.objective import ttt_loss
from eyas.shards.format import ShardMeta, read_shard_layout
from eyas.shards.manifest import MANIFEST_NAME, read_manifest
from eyas.shards.reader import ShardSamples
from eyas.storage import Storage, as_storage
from eyas.target import load_embed_and_lm_head
from eyas.train.data import collate

DIAGNOSIS_FILE = "diagnosis.json"
SERVING_TAU_CEILING = 1.2  # tau at or below this with a good teacher-forced accuracy points at serving


@dataclass
class Check:
    name: str
    passed: bool | None  # None: not applicable here
    detail: str


@dataclass
class Diagnosis:
    tau: float | None
    checks: list[Check] = field(default_factory=list)
    conclusion: str = ""

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.passed is False]

    def to_dict(self) -> dict:
        return {"tau": self.tau, "conclusion": self.conclusion, "checks": [asdict(c) for c in self.checks]}

    def to_markdown(self) -> str:
        mark = {True: "passed", False: "FAILED", None: "n/a"}
        rows = [f"| {c.name} | {mark[c.passed]} | {c.detail.replace('|', '/')} |" for c in self.checks]
        return "\n".join(["| check | result | detail |", "|---|---|---|", *rows, "", f"**{self.conclusion}**"])


def _shard_widths(store: Storage, scratch: Path, draft_hidden: int | None) -> tuple[Check, ShardMeta | None]:
    rows = read_manifest(store) if store.exists(MANIFEST_NAME) else []
    if not rows:
        return Check("shard_widths", False, f"{store.url}: no shards in a manifest; extract first"), None
    first = _local_file(store, rows[0].file, scratch)
    try:
        meta, layout = read_shard_layout(first)
    except (OSError, ValueError) as err:  # unreadable or foreign: the check says so, the report goes on
        return Check("shard_widths", False, f"{first.name}: {err}"), None
    aux_w, h, n = layout["aux_hidden_states"][1][-1], meta.hidden_size, meta.num_aux
    expected_h = draft_hidden or h
    # a top-K teacher has no H-wide tensor: its check is the aux width alone
    last_w = layout["last_hidden_states"][1][-1] if "last_hidden_states" in layout else expected_h
    if aux_w != n * expected_h or last_w != expected_h:
        cause = " (H wide: the target sent no aux states, the draft bypasses fc)" if aux_w == expected_h else ""
        detail = (
            f"{first.name}: aux_hidden_states width {aux_w}, last_hidden_states {last_w}; expected "
            f"{n * expected_h} ({n} layers x {expected_h}) and {expected_h}{cause}; re-extract with aux capture"
        )
        return Check("shard_widths", False, detail), meta
    teacher = f"last {last_w}" if meta.teacher == "last_hidden" else f"teacher top-{meta.teacher_topk}"
    return Check("shard_widths", True, f"{first.name}: aux {aux_w} = {n} x {h}, {teacher}"), meta


def _local_file(store: Storage, name: str, scratch: Path) -> Path:
    """The shard's file: in place in a local directory, else downloaded into `scratch` (its header is read)."""
    if store.local_path() is not None:
        return store.local_path() / name
    if not (scratch / name).is_file():
        store.download_to(name, scratch / name)
    return scratch / name


def _export_tensors(export_dir: Path) -> tuple[dict, dict[str, tuple[int, ...]]]:
    config = json.loads((export_dir / "config.json").read_text())
    with safe_open(str(export_dir / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return config, shapes


def _export_format(export_dir: Path) -> str:
    """The SGLang format of an export: its eyas_export.json's, else `sglang` (midlayer.*)."""
    provenance = read_export_provenance(export_dir) or {}
    return provenance.get("format") if provenance.get("format") in SGLANG_FORMAT_SINCE else "sglang"


def _arch(config: dict, shapes: dict, fmt: str = "sglang") -> DraftArch:
    """The arch the export's config describes (eyas.export.configs); draft_vocab_size falls back to lm_head's
    rows when absent (its own check reports the absence)."""
    fields = dict(read_config(fmt, config).arch)
    if fields["draft_vocab_size"] is None:
        fields["draft_vocab_size"] = shapes.get("lm_head.weight", (fields["target_vocab_size"],))[0]
    return DraftArch(**fields)


def _export_checks(export_dir: Path, config: dict, shapes: dict) -> list[Check]:
    checks = []
    try:
        fmt = _export_format(export_dir)
        check_keys(shapes, expected_shapes(fmt, _arch(config, shapes, fmt)), where=f"export {export_dir}")
        checks.append(Check("export_key_set", True, f"{len(shapes)} keys, exactly SGLang's set and shapes"))
    except ValueError as err:  # KeyCheckError lists every offender; ConfigError names the missing field
        checks.append(Check("export_key_set", False, str(err).replace("\n", "; ")))
    if "d2t" not in shapes or "t2d" not in shapes:
        detail = "no d2t/t2d in model.safetensors: draft ids reach the target unmapped (tau about 1.1); re-export"
        checks.append(Check("d2t_offsets", False, detail))
    else:
        with safe_open(str(export_dir / "model.safetensors"), framework="pt") as f:
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        try:
            check_vocab_mapping(d2t, t2d, f"export {export_dir}", config.get("draft_vocab_size"))
            checks.append(Check("d2t_offsets", True, f"d2t holds offsets for {d2t.numel()} draft ids"))
        except ValueError as err:  # VocabMappingError names the first bad id
            checks.append(Check("d2t_offsets", False, str(err)))
    if "draft_vocab_size" in config:
        checks.append(Check("draft_vocab_size_explicit", True, f"draft_vocab_size {config['draft_vocab_size']}"))
    else:
        detail = "config.json has no draft_vocab_size: SGLang swaps the trained lm_head for the target's; re-export"
        checks.append(Check("draft_vocab_size_explicit", False, detail))
    return checks


def _layer_ids(config: dict, shard_meta: ShardMeta | None, target_path: str | Path) -> Check:
    engine = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if engine is None or shard_meta is None:
        return Check("layer_id_convention", False, f"layer ids missing: export {engine}, shards {shard_meta}")
    # SGLang numbers a draft's ids by the target's family (eyas.layer_ids.sglang_convention)
    engine_convention = sglang_convention(target_layout(json.loads((Path(target_path) / "config.json").read_text()))[0])
    canonical = from_engine_layer_ids(list(engine), engine_convention)
    shards, convention = list(shard_meta.aux_layer_ids), shard_meta.layer_id_convention
    if canonical != shards or convention != LAYER_ID_CONVENTION:
        detail = (
            f"export eagle_aux_hidden_state_layer_ids {engine} ({engine_convention}) = hidden_states "
            f"{canonical}, shards extracted at {shards} ({convention}); the engine captures other layers than "
            "training saw"
        )
        return Check("layer_id_convention", False, detail)
    return Check(
        "layer_id_convention",
        True,
        f"export {engine} ({engine_convention}) = shards {shards} ({LAYER_ID_CONVENTION})",
    )


def _launch_flags(launch_argv: list[str] | None, shard_ids: list[int] | None) -> Check:
    if launch_argv is None:
        return Check("launch_flags", None, "reference engine: no serving command to lint")
    problems = lint_launch_command(launch_argv, shard_aux_layer_ids=shard_ids)
    return Check("launch_flags", not problems, "; ".join(problems) or " ".join(launch_argv))


def teacher_forced_accuracy(
    export_dir, shards, target_path, *, num_samples: int, steps: int, cache_dir=None, cache_bytes: int = 0
) -> list[float]:
    """Top-1 agreement of the exported draft with the target over the draft vocab, per unroll step,
    on the loss-masked tokens of the first num_samples shard samples (the training objective's accuracy).
    Shards on S3 are read through a shard cache of `cache_bytes` in `cache_dir`."""
    embed, lm_head = load_embed_and_lm_head(target_path)
    draft = load_exported_draft(export_dir, embed.float())
    samples = ShardSamples(shards, cache_dir=cache_dir, cache_bytes=cache_bytes)
    try:
        ids = list(range(min(num_samples, len(samples))))
        samples.plan(ids)
        chosen = [samples.load_sample(i) for i in ids]
    finally:
        samples.close()
    batch = collate(chosen, max_len=draft.arch.max_position_embeddings - steps)
    with torch.no_grad():
        _, _, accs, _ = ttt_loss(draft, batch, lm_head[draft.t2d].float(), steps, 1.0)
    return [float(a) for a in accs]


def _accuracy_check(export_dir, shards, target_path, num_samples, steps, min_accuracy, cache) -> Check:
    try:
        cache_dir, cache_bytes = cache
        accs = teacher_forced_accuracy(
            export_dir,
            shards,
            target_path,
            num_samples=num_samples,
            steps=steps,
            cache_dir=cache_dir,
            cache_bytes=cache_bytes,
        )
    except ValueError as err:  # a broken export or shard: its own check names the cause
        return Check("teacher_forced_accuracy", False, f"could not run the draft on the shards: {err}")
    shown = ", ".join(f"{a:.2f}" for a in accs)
    if accs[0] < min_accuracy:
        detail = f"per step [{shown}] on {num_samples} shard samples; step 0 below {min_accuracy}: the draft is weak"
        return Check("teacher_forced_accuracy", False, detail)
    return Check("teacher_forced_accuracy", True, f"per step [{shown}] on {num_samples} shard samples")


def diagnose(
    *,
    export_dir: str | Path,
    shards_dir: str | Path | Storage,
    target_path: str | Path,
    tau: float | None,
    launch_argv: list[str] | None = None,
    num_samples: int = 8,
    steps: int = 3,
    min_accuracy: float = 0.3,
    cache_bytes: int = 0,
) -> Diagnosis:
    """Run every check; each names what it found and the fix. Never raises for a failed check. `shards_dir`
    may be a storage without a local path (S3): its first shard's header is read from a download, the samples
    through a shard cache of `cache_bytes`, both in a temporary directory removed at the end."""
    export_dir, store = Path(export_dir), as_storage(shards_dir)
    if store.local_path() is None and not cache_bytes:
        raise ValueError(f"diagnose: shards {store.url} are not local; pass cache_bytes (the run's train.cache_bytes)")
    config, shapes = _export_tensors(export_dir)
    with tempfile.TemporaryDirectory(prefix="eyas-diagnose-") as scratch:
        widths, shard_meta = _shard_widths(store, Path(scratch), config.get("hidden_size"))
        checks = [widths, *_export_checks(export_dir, config, shapes), _layer_ids(config, shard_meta, target_path)]
        shard_ids = list(shard_meta.aux_layer_ids) if shard_meta is not None else None
        checks.append(_launch_flags(launch_argv, shard_ids))
        cache = (Path(scratch) / "shard-cache", cache_bytes) if store.local_path() is None else (None, 0)
        checks.append(_accuracy_check(export_dir, store, target_path, num_samples, steps, min_accuracy, cache))
    report = Diagnosis(tau=tau, checks=checks)
    report.conclusion = _conclusion(report)
    return report


def _conclusion(report: Diagnosis) -> str:
    accuracy = next(c for c in report.checks if c.name == "teacher_forced_accuracy")
    others = [c.name for c in report.failed if c is not accuracy]
    if others:
        return f"failed checks: {', '.join(others)}; fix these first"
    if accuracy.passed and report.tau is not None and report.tau <= SERVING_TAU_CEILING:
        return (
            f"the draft predicts the target well on its training data but serving tau is {report.tau:.2f}: "
            "the serving side is wrong (hidden states, layer ids, flags or weights the engine loads)"
        )
    if accuracy.passed is False:
        return "every file check passed but the draft is weak: more or better data, longer training"
    return "every check passed; tau is low for another reason (prompt domain, steps, max_new_tokens)"


def diagnose_run(config: RunConfig, export_dir: str | Path, result: dict) -> Diagnosis:
    """The stage entry after a low tau: every check on the run's export and shards; writes diagnosis.json."""
    b = config.bench
    report = diagnose(
        export_dir=export_dir,
        shards_dir=shard_source(config),
        target_path=config.target.model_path,
        tau=result["tau_mean"],
        launch_argv=result.get("launch_command"),
        num_samples=b.diagnose_num_samples,
        steps=b.num_steps,
        min_accuracy=b.min_teacher_forced_accuracy,
        cache_bytes=config.train.cache_bytes,
    )
    path = config.paths.bench_dir / DIAGNOSIS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(report.to_dict(), indent=2) + "\n")
    return report


def read_diagnosis(bench_dir: str | Path) -> dict | None:
    """diagnosis.json of a run's last low-tau diagnosis, or None when there is none."""
    return read_json_record(Path(bench_dir) / DIAGNOSIS_FILE)
