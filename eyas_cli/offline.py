"""The verbs that read a drafter, a target or a train directory on disk, without Prefect: `eyas inspect`,
`eyas remap`, `eyas target`, `eyas stop`. A path that is missing, or a file where a directory belongs, is refused
before the library (and torch) is imported."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eyas_cli.errors import UserError
from eyas_cli.path_errors import blocking_file, explain_read_error

DRAFTER_DIR = "a drafter checkpoint directory (config.json and model.safetensors: an eyas checkpoint or an export)"
TARGET_DIR = "a Hugging Face model directory (config.json, *.safetensors, the tokenizer)"


def need_directory(what: str, path: str | None, expected: str) -> None:
    """A UserError naming `what` unless `path` (when given) is a directory."""
    if path is None or Path(path).is_dir():
        return
    found = "a file" if Path(path).exists() else "no such directory"
    fix = "name the directory that holds it" if Path(path).exists() else "fix the path"
    raise UserError(f"{what} {path}: {found}; expected {expected}; {fix}")


def run_inspect(args: argparse.Namespace) -> int:
    need_directory("eyas inspect", args.path, DRAFTER_DIR)
    need_directory("eyas inspect --target", target_dir(args.target), TARGET_DIR)
    from eyas.export.inspect import inspect_drafter

    try:
        report = inspect_drafter(
            args.path, num_target_layers=args.num_target_layers, engine=args.engine, target=args.target
        )
    except (OSError, ValueError) as err:
        print(f"eyas inspect: {explain_read_error(err, [args.path, target_dir(args.target) or args.path])}",
              file=sys.stderr)  # fmt: skip
        return 2
    print(report.text)
    return 0 if report.ok else 1


def target_dir(target: str | None) -> str | None:
    """--target names the target's directory or its config.json: the directory either way."""
    return str(Path(target).parent) if target and Path(target).name == "config.json" else target


def run_remap(args: argparse.Namespace) -> int:
    from eyas.export.keys import FORMATS

    if args.to not in FORMATS:
        print(f"eyas remap --to {args.to}: unknown format; expected one of {sorted(FORMATS)}", file=sys.stderr)
        return 2
    need_directory("eyas remap", args.src, DRAFTER_DIR)
    need_directory("eyas remap --target", target_dir(args.target), TARGET_DIR)
    blocker = blocking_file(Path(args.dst).absolute())
    if blocker is not None:
        raise UserError(
            f"eyas remap {args.src} {args.dst}: {blocker} is a file; expected a directory to write the converted "
            "drafter to (created when missing); name another destination, or move the file away"
        )
    if args.embed_from and not Path(args.embed_from).exists():
        raise UserError(
            f"eyas remap --embed-from {args.embed_from}: no such file or directory; expected the target's directory "
            "or a safetensors file holding its embed_tokens; fix the path"
        )
    from eyas.export.remap import remap_checkpoint

    try:
        out = remap_checkpoint(
            args.src,
            args.dst,
            to=args.to,
            dtype=args.dtype,
            embed_from=args.embed_from,
            num_target_layers=args.num_target_layers,
            sglang_version=args.sglang_version,
            target=args.target,
        )
    except (OSError, ValueError) as err:
        places = [args.src, target_dir(args.target) or args.src, args.embed_from or args.src]
        print(f"eyas remap: {explain_read_error(err, places)}", file=sys.stderr)
        return 2  # bad input: the source cannot be converted as asked
    print(f"{args.src} -> {out} ({args.to}); key set and shapes checked")
    return 0


def show_target(args: argparse.Namespace) -> int:
    path, as_json = args.path, args.json
    need_directory("eyas target", path, TARGET_DIR)
    from eyas.target import TargetError, TargetFacts

    try:
        facts = TargetFacts.read(path).summary()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        print(f"eyas target: {explain_read_error(err, [path])}", file=sys.stderr)
        return 2
    except (OSError, KeyError, TargetError) as err:
        print(f"eyas target: {err}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(facts, indent=1))
        return 0
    arch = ", ".join(facts["architectures"])
    text = ", ".join(facts["text_architectures"])
    print(f"target {path}: {arch}" + (f" (text model {text})" if text != arch else ""))
    print(
        f"  layers {facts['num_layers']}, hidden {facts['hidden_size']}, vocab {facts['vocab_size']} (embedding "
        f"rows), tied embeddings {str(facts['tie_word_embeddings']).lower()}, fingerprint {facts['fingerprint']}"
    )
    print(f"  default aux layer ids {facts['default_aux_layer_ids']} (hf_hidden_states)")
    for numbering, ids in facts["layer_numbering"].items():
        print(f"    {numbering}: {ids}")
    if facts.get("sglang_refuses"):
        print(f"  SGLang: {facts['sglang_refuses']}")
    if facts["remote_code"]:
        print(f"  needs its own code to load (target.trust_remote_code: true): {facts['remote_code']}")
    return 0


def run_stop(args: argparse.Namespace) -> int:
    need_directory("eyas stop", args.train_dir, "a run's train directory (RUN/train)")
    from eyas.train.nodes import NODES_DIR, SILENT_AFTER_S, STOP_FILE, describe_node
    from eyas.train.preflight import STOP_WAIT_S, stop_job

    train_dir = Path(args.train_dir)
    print(f"stop requested in {train_dir / STOP_FILE}: every rank of the job, on every node, stops after its current "
          f"step, saves a checkpoint there and exits; the launchers recorded here get up to {STOP_WAIT_S:.0f} s to end "
          "while their job's nodes report", flush=True)  # fmt: skip
    done = stop_job(train_dir)
    for node in done["nodes"]:
        print(f"  {describe_node(node)}")
    if done["exited"]:
        print(f"exited after the stop: {done['exited']}")
    if done["killed"]:
        print(f"stopped {done['killed']} with SIGTERM (SIGKILL after 10 s): not ended on its own")
    if not done["exited"] and not done["killed"]:
        print(f"no process recorded in {train_dir} is running")
    if not done["nodes"] and not done["exited"] and not done["killed"]:
        print(
            f"no job was found running: no node recorded in {train_dir / NODES_DIR} was seen training in the last "
            f"{SILENT_AFTER_S:.0f} s; the request stays until the next launch, which clears it when it starts (a "
            "launch never starts stopped)"
        )
    print(
        "`eyas status` shows the nodes and where they stopped; `eyas train CONFIG` resumes from the newest checkpoint"
    )
    return 0
