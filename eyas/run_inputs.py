"""The mistakes a user can foresee in a run's config, found when the run's facts are resolved: before the first
expensive step (regeneration, a model load, extraction, a trainer), for every stage that will run.

    check_run_inputs(config, STAGES)         # the pipeline, at its start
    check_run_inputs(config, ["bench"])      # a stage run alone, before its own work

Every problem is collected and raised at once as one RunInputError (a ValueError: a user error, which the
`eyas` command answers with its message and exit code 2), each naming the object, what was expected, what was
found and the fix. For the stages that will run:
- paths: the workdir (a directory, or one that can be created there); target.model_path (a directory whose
  config.json and weight headers read); dataset.prompts_path and bench.prompts_path (readable files whose rows
  parse); sglang.python where a stage launches SGLang; a local train.checkpoint_copy_url; the vocab mapping a
  training without the dataset stage reads;
- vocab sizes: dataset.draft_vocab_size against the target's vocab (its embedding rows), and the mapping built
  by an earlier dataset stage against the config;
- process counts: train.num_processes against the GPUs torch sees (nccl) or the CPU cores this process may use
  (gloo: one trainer process per core at most; eyas.train.preflight). The count is per node (torchrun
  --nproc_per_node): with train.num_nodes above 1 this machine is checked as one of the run's nodes, each of
  which starts num_processes trainers; the run's world (num_processes x nodes) is what the memory plan assumes;
- a look at the dataset: the conversations that give a sample to train on (as_given: one with an assistant
  turn; regenerate: one with a user turn to answer), refused when the others are more than
  dataset.max_empty_mask_fraction of them (the dataset stage would fail on them after its work, or train on
  a handful).
Then, with their own errors: a draft.variant the export's servers would not run, aux layer ids SGLang cannot be
given for the target, and (training) a memory plan that does not fit.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from eyas.config import RunConfig
from eyas.target import TargetFacts

STAGES = ("dataset", "extract", "verify", "train", "export", "bench")


class RunInputError(ValueError):
    """A run's config names something that is missing, unreadable or does not fit; the message lists every one."""


def check_run_inputs(config: RunConfig, stages: Sequence[str] = STAGES, *, found: dict | None = None) -> dict:
    """Raise RunInputError listing every problem of `stages`' inputs (see the module docstring); then the variant,
    layer-id and memory-plan checks raise their own errors. `found`: eyas.train.devices' query for a CUDA
    training (queried when None). Returns what was looked at (the dataset's counts, the processes' limit)."""
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        raise ValueError(f"check_run_inputs: stages {unknown}; expected some of {list(STAGES)}")
    problems, seen = path_problems(config, stages), {}
    target, problem = read_target(config)
    problems += [problem] if problem else []
    if target is not None:
        problems += vocab_problems(config, target, stages)
    if "dataset" in stages and not any(p.startswith("dataset.prompts_path") for p in problems):
        seen["dataset"], problem = dataset_look(config)
        problems += [problem] if problem else []
    if "bench" in stages and not any(p.startswith("bench.prompts_path") for p in problems):
        problems += bench_prompt_problems(config)
    if "train" in stages:
        found, more = process_problems(config, found)
        problems += more
        seen["processes"] = config.train.num_processes
    if problems:
        raise RunInputError(
            f"{len(problems)} problem(s) in the run's inputs, found before any stage started its work:\n"
            + "\n".join(f"- {p}" for p in problems)
        )
    check_served_and_planned(config, target, stages, found)
    return seen


def check_served_and_planned(config: RunConfig, target: TargetFacts, stages, found: dict | None) -> None:
    """The checks with their own errors: variant served, aux layer ids SGLang can be given, the memory plan."""
    from eyas.export.serving import check_variant_served
    from eyas.facts import check_layer_ids

    check_variant_served(config)
    check_layer_ids(config, target)
    if "train" in stages:
        from eyas.train.devices import MIB
        from eyas.train.memory_plan import check_run_plan

        used = (found or {}).get("devices", [])[: config.train.num_processes]
        smallest = min((r["memory_total_mib"] for r in used), default=0) if config.train.backend == "nccl" else 0
        check_run_plan(config, target, device_bytes_found=smallest * MIB)


# ---- paths ------------------------------------------------------------------------------------------------


def file_problem(name: str, path: str | Path, expected: str) -> str | None:
    """`name`'s file missing, a directory, or unreadable; None when it can be read."""
    path = Path(path)
    if not path.exists():
        return f"{name}={str(path)!r}: no such file, expected {expected}; fix the path (relative paths are read from {os.getcwd()})"
    if path.is_dir():
        return f"{name}={str(path)!r}: a directory, expected {expected} (a file); name the file itself"
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as err:
        return f"{name}={str(path)!r}: cannot be read ({err.strerror}), expected {expected}; fix its permissions"
    return None


def dir_problem(name: str, path: str | Path, fix: str) -> str | None:
    """`name`'s directory, which a stage creates and writes: a file there (or on the way), or not writable."""
    path = Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "" if existing == path else f" ({existing} on the way is a file)"
        return f"{name}={str(path)!r}: a file{where}, expected a directory; {fix}"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{name}={str(path)!r}: {existing} is not writable by this user, expected a writable directory; {fix}"
    return None


def path_problems(config: RunConfig, stages) -> list[str]:
    """The paths every stage of `stages` reads or writes, except the target's (read_target)."""
    problems = [dir_problem("workdir", config.workdir, "choose a directory for the run's outputs")]
    paths = config.paths
    for folder in (paths.dataset_dir, paths.shards_dir, paths.smoke_dir, paths.train_dir, paths.export_dir,
                   paths.bench_dir):  # fmt: skip
        if folder.exists() and not folder.is_dir():
            problems.append(
                f"workdir={config.workdir!r}: {folder} is a file, expected the directory a stage writes its outputs "
                "in; move or remove that file, or choose another workdir"
            )
    if "dataset" in stages:
        problems.append(file_problem("dataset.prompts_path", config.dataset.prompts_path,
                                     "JSONL or Parquet of conversations"))  # fmt: skip
    if "bench" in stages:
        problems.append(file_problem("bench.prompts_path", config.bench.prompts_path, "held-out prompts JSONL"))
    if config.sglang.python and launches_sglang(config, stages):
        python = Path(config.sglang.python)
        if not (python.is_file() and os.access(python, os.X_OK)):
            found = "no such file" if not python.exists() else "not an executable file"
            problems.append(
                f"sglang.python={config.sglang.python!r}: {found}, expected the interpreter of SGLang's environment "
                "(e.g. /opt/sglang/bin/python); fix the path, or leave it empty to run SGLang beside eyas"
            )
    copy = config.train.checkpoint_copy_url
    if "train" in stages and copy.startswith("/"):
        problems.append(dir_problem("train.checkpoint_copy_url", copy, "name a directory, or an s3:// URL"))
    return [p for p in problems if p]


def launches_sglang(config: RunConfig, stages) -> bool:
    """Whether one of `stages` starts an SGLang server (in sglang.python's environment)."""
    gen = config.dataset.generation
    return (
        ("dataset" in stages and gen.generator == "sglang" and not gen.server_urls)
        or ("extract" in stages and config.extract.backend == "sglang" and not config.extract.sglang.server_url)
        or ("bench" in stages and config.bench.engine == "sglang")
    )


def read_target(config: RunConfig) -> tuple[TargetFacts | None, str | None]:
    """The target's facts (config.json and weight headers), or the problem reading them."""
    path = Path(config.target.model_path)
    if not path.is_dir():
        found = "a file" if path.exists() else "no such directory"
        return None, (
            f"target.model_path={str(path)!r}: {found}, expected a Hugging Face model directory (config.json, "
            "*.safetensors, the tokenizer); fix the path"
        )
    try:
        return TargetFacts.read(path), None
    except (OSError, ValueError, KeyError) as err:
        text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
        return None, f"target.model_path={str(path)!r}: {text}"


# ---- vocab sizes and processes ------------------------------------------------------------------------------


def vocab_problems(config: RunConfig, target: TargetFacts, stages) -> list[str]:
    """dataset.draft_vocab_size within the target's vocab; a training without the dataset stage reads a mapping of
    the configured sizes."""
    draft = config.dataset.draft_vocab_size
    if draft > target.vocab_size:
        return [
            f"dataset.draft_vocab_size={draft}: larger than the target's vocab of {target.vocab_size} tokens "
            f"(the rows of its input embedding, {config.target.model_path}), expected at most {target.vocab_size}; "
            f"lower dataset.draft_vocab_size (EAGLE-3 drafts keep the most frequent 32,000 or fewer)"
        ]
    path = config.paths.vocab
    if "train" not in stages or "dataset" in stages:
        return []
    if not path.is_file():
        return [f"vocab mapping {path}: no such file, expected the dataset stage's output; run `eyas dataset CONFIG`"]
    from safetensors import SafetensorError

    from eyas.dataset.vocab import vocab_sizes

    try:
        sizes = vocab_sizes(path)
    except (OSError, ValueError, SafetensorError) as err:
        return [f"vocab mapping {path}: unreadable ({err}); run `eyas dataset CONFIG` to rebuild it"]
    if sizes != (draft, target.vocab_size):
        return [
            f"vocab mapping {path}: {sizes[0]} draft ids over {sizes[1]} target ids, expected dataset.draft_vocab_size="
            f"{draft} over the target's {target.vocab_size}; run `eyas dataset CONFIG` to rebuild it for this config"
        ]
    return []


def process_problems(config: RunConfig, found: dict | None) -> tuple[dict | None, list[str]]:
    """train.num_processes against this machine: the usable cores (gloo) or the GPUs torch sees (nccl, queried in a
    subprocess unless `found` is given). Returns the query's result (None on CPU) and the problems."""
    from eyas.train.devices import DeviceQueryFailed, query_devices, usable_cores
    from eyas.train.preflight import cpu_process_problems, gpu_count_problems

    train = config.train
    if train.backend == "gloo":
        return None, cpu_process_problems(train, usable_cores())
    try:
        found = query_devices() if found is None else found
    except DeviceQueryFailed as err:
        return None, [str(err)]
    return found, gpu_count_problems(train, found)


# ---- the dataset and the held-out prompts ---------------------------------------------------------------------


def dataset_look(config: RunConfig) -> tuple[dict, str | None]:
    """How many of the conversations the dataset stage will use give a sample to train on, and the problem when
    the rest are more than dataset.max_empty_mask_fraction (or the file cannot be read as conversations)."""
    from eyas.dataset.prompts import DatasetError

    cfg = config.dataset
    path = Path(cfg.prompts_path)
    stat = path.stat()
    try:
        total, lacking = _untrainable(str(path.absolute()), stat.st_mtime_ns, stat.st_size, cfg.num_samples,
                                      cfg.responses)  # fmt: skip
    except (DatasetError, OSError) as err:
        return {}, f"dataset.prompts_path={str(path)!r}: {err}"
    seen = {"conversations": total, "without_turn_to_train_on": lacking}
    if lacking <= cfg.max_empty_mask_fraction * total:
        return seen, None
    if cfg.responses == "as_given":
        why = (
            "no assistant turn, and dataset.responses='as_given' trains only on the file's assistant turns",
            "add the assistant answers, or set dataset.responses='regenerate' to have the target write them",
        )
    else:
        why = (
            "no user turn, and dataset.responses='regenerate' has the target answer each conversation's last user turn",
            "give each conversation a user turn, or remove those rows",
        )
    return seen, (
        f"dataset.prompts_path={str(path)!r}: {lacking} of {total} conversations have {why[0]}: more than "
        f"dataset.max_empty_mask_fraction={cfg.max_empty_mask_fraction} of the samples would have nothing to train "
        f"on; expected conversations to train on: {why[1]}"
    )


@lru_cache(maxsize=4)
def _untrainable(path: str, mtime_ns: int, size: int, num_samples: int, responses: str) -> tuple[int, int]:
    """(conversations, those without the turn `responses` needs), read once per file version and process (the
    pipeline's check and the dataset flow's own both look)."""
    from eyas.dataset.conversations import read_conversations

    rows, _ = read_conversations(path, num_samples)
    role = "assistant" if responses == "as_given" else "user"
    return len(rows), sum(1 for r in rows if not any(t["role"] == role for t in r["conversations"]))


def bench_prompt_problems(config: RunConfig) -> list[str]:
    """bench.prompts_path read as the benchmark reads it (eyas.dataset.prompts.read_prompts)."""
    from eyas.dataset.prompts import DatasetError, read_prompts

    path = config.bench.prompts_path
    try:
        read_prompts(path, config.bench.num_prompts)
    except DatasetError as err:  # read_prompts names the line, what it expected and the fix
        return [f"bench.prompts_path={path!r}: {err}"]
    except (OSError, ValueError) as err:
        return [
            f"bench.prompts_path={path!r}: {err}; expected JSONL rows {{id, conversations: [{{role, content}}, ...]}} "
            "ending with a user turn"
        ]
    return []
