"""eyas: train EAGLE-3 drafters for a target LLM and prove they work.

Usage:
  eyas demo [--approve yes|no]           the whole pipeline on the bundled tiny target
  eyas run CONFIG [--approve yes|no]     the whole pipeline for a preset (JSON RunConfig)
  eyas dataset|extract|verify|train|export|bench CONFIG    one stage
  eyas worker [--pool P] [--results-dir D] [--within-s S] [--setup-only]   eyas's worker of the process pool
  eyas deploy --name PATTERN | --all     prefect deploy of prefect.yaml, then which worker to start
  eyas approve RUN_ID [--reject] [--note TEXT] [--reviewer NAME]
  eyas inspect PATH [--target T] [--engine E]   audit a drafter checkpoint (no Prefect, no torch)
  eyas remap SRC DST --to FORMAT [--sglang-version V] [--target T] [--dtype D] [--embed-from F]
  eyas stop TRAIN_DIR                    stop the trainer processes eyas started there (and only those)
  eyas status [RUN] [--json]             where a run stands and what to run next (RUN: config, workdir or flow-run id)
  eyas engine-command CONFIG --stage generate|extract|bench|baseline [--json]   the SGLang server a stage starts
  eyas target PATH [--json]              a target's facts from config.json and weight headers (no weights, no code)
  eyas plan CONFIG [--json]              the training's memory per device: components, peak, budget, micro-batch
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_PRESET = REPO / "deployments" / "tiny-cpu.json"
STAGES = ("dataset", "extract", "verify", "train", "export", "bench")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from eyas.export.serving import ENGINES

    parser = argparse.ArgumentParser(prog="eyas", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="print the traceback of any error (or EYAS_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the pipeline on the tiny target")
    demo.add_argument("--workdir", default="runs/demo")
    run = sub.add_parser("run", help="run the whole pipeline for a preset")
    run.add_argument("config")
    for p in (demo, run):
        p.add_argument(
            "--approve",
            choices=["yes", "no"],
            default=os.environ.get("APPROVE") or None,
            help="answer the approval gate without asking (default: ask; env APPROVE)",
        )
    for stage in STAGES:
        sub.add_parser(stage, help=f"run the {stage} stage's flow").add_argument("config")
    from eyas_cli.worker import add_arguments as worker_arguments

    worker_arguments(sub.add_parser("worker", help="set up and start the worker of eyas's process pool"))
    deploy = sub.add_parser("deploy", help="deploy prefect.yaml's deployments, then say which worker to start")
    which = deploy.add_mutually_exclusive_group(required=True)
    which.add_argument("--name", help="deployment name or pattern, e.g. '*-tiny-cpu'")
    which.add_argument("--all", action="store_true", help="every deployment in prefect.yaml")
    approve = sub.add_parser("approve", help="answer a run waiting at the approval gate")
    approve.add_argument("run_id")
    approve.add_argument("--reject", action="store_true")
    approve.add_argument("--note", default="")
    approve.add_argument("--reviewer", default=getpass.getuser())
    inspect = sub.add_parser("inspect", help="audit a drafter checkpoint directory")
    inspect.add_argument("path")
    stop = sub.add_parser(
        "stop",
        help="stop a training job on every node (a stop request all ranks agree on, a checkpoint at that step), "
        "then this host's recorded launchers if they have not left",
    )
    stop.add_argument("train_dir")
    status = sub.add_parser("status", help="where a run stands: stages, progress, next command, files")
    status.add_argument(
        "run", nargs="?", default=str(DEMO_PRESET), help="a run config (JSON), a run's workdir, or a flow-run id"
    )
    status.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    target = sub.add_parser("target", help="a target's facts from config.json and weight headers")
    target.add_argument("path")
    target.add_argument("--json", action="store_true", help="print the facts as JSON")
    plan = sub.add_parser("plan", help="the memory plan of the run's training, per device (no Prefect, no dataset)")
    plan.add_argument("config")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON (MemoryPlan.to_dict())")
    engine = sub.add_parser("engine-command", help="print the SGLang launch command a stage would run")
    engine.add_argument("config")
    engine.add_argument("--stage", required=True, choices=["generate", "extract", "bench", "baseline"])
    engine.add_argument("--json", action="store_true", help="print {stage, argv, command} as JSON")
    remap = sub.add_parser("remap", help="convert a drafter checkpoint to another format")
    remap.add_argument("src")
    remap.add_argument("dst")
    remap.add_argument("--to", required=True, help="eyas, sglang, sglang-0.5.12, vllm, speculators or eagle")
    remap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: keep the source's")
    remap.add_argument("--embed-from", help="safetensors file with the target's embed_tokens (formats that keep it)")
    remap.add_argument(
        "--sglang-version",
        help="sglang formats: the oldest SGLang release the export must run on (decides the draft options it may carry)",
    )
    for p in (inspect, remap):
        p.add_argument("--num-target-layers", type=positive_int, help="the target's layer count (layer-id checks)")
        p.add_argument(
            "--target",
            help="the target model's directory or config.json: its layer count and SGLang's numbering (inspect: "
            "also its hidden size and vocab, which the drafter must match)",
        )
    inspect.add_argument(
        "--engine", choices=sorted(ENGINES), help="an engine version that must fill every tensor and run every option"
    )
    return parser.parse_args(argv)


def positive_int(text: str) -> int:
    """An argparse type: a whole number above 0 (argparse's message names the option and the value)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number above 0")
    return int(text)


def load_config(path: str, workdir: str | None = None):
    from pydantic import ValidationError

    from eyas.config import RunConfig, load_run_config
    from eyas_cli.errors import PRESET_HINT, UserError, format_validation_error

    if not Path(path).is_file():
        found = "a directory" if Path(path).is_dir() else "no such file"
        raise UserError(f"config {path}: {found}; expected a JSON RunConfig file, e.g. {PRESET_HINT}")
    try:
        config = load_run_config(path)
    except ValidationError as err:
        raise UserError(format_validation_error(err, f"config {path}", RunConfig)) from None
    except UnicodeDecodeError as err:
        raise UserError(f"config {path}: not text ({err}); expected a JSON RunConfig") from None
    return config.model_copy(update={"workdir": workdir}) if workdir else config


def start_in_process(config) -> tuple[str, str]:
    """Before a command runs flows in its own process: the server (PREFECT_API_URL set before prefect is
    imported), heartbeats every HEARTBEAT_S and the crash automation, so that the server marks these runs
    Crashed if this process dies, and a launch record in the workdir, so that `eyas status` knows at once
    whether this process still lives (eyas.status.launches). Returns (API URL, the tag of its flow runs)."""
    from eyas.status.launches import TAG_PREFIX, record_launch
    from eyas_cli.automation import HEARTBEAT_S, crash_window_s, install_crash_detection
    from eyas_cli.path_errors import blocking_file
    from eyas_cli.server import connect

    if blocking_file(config.paths.root.absolute()) is not None:  # refused before a server is started for it
        raise NotADirectoryError(20, "Not a directory", str(config.paths.root))
    os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(HEARTBEAT_S))
    within_s = crash_window_s()  # a bad EYAS_CRASH_WITHIN_S is refused before anything starts
    api = connect()
    install_crash_detection(within_s)
    tag = f"{TAG_PREFIX}{uuid.uuid4().hex[:8]}"
    record_launch(config.paths.root, tag)
    return api, tag


def run_pipeline(config, answer: str | None) -> int:
    api, tag = start_in_process(config)  # must run before anything imports prefect
    from prefect import tags

    from eyas.gate.summary import SUMMARY_FILE
    from eyas_cli.approval import GateWatcher
    from eyas_cli.errors import quiet_user_error_tracebacks, raise_user_error
    from eyas_cli.server import ui_url
    from flows.pipeline import pipeline

    quiet_user_error_tracebacks()
    GateWatcher(tag, ui_url(api), answer, summary_path=config.paths.root / SUMMARY_FILE).start()
    with tags(tag, f"config-{config.name}"):
        state = pipeline(config, return_state=True)
    raise_user_error(state)  # a stage refused its input: its message and exit code 2
    if not state.is_completed():
        print(f"\npipeline ended {state.name}: {state.message}", file=sys.stderr)
        return 1
    print_outcome(config, state.result())
    return 0


def print_outcome(config, result: dict) -> None:
    """What a finished pipeline leaves a person: the figures, where the drafter is, how to serve it."""
    import shlex

    from eyas.bench.acceptance import describe_benchmark
    from eyas.export.convert import SGLANG_EXPORT
    from eyas_cli.engine_command import engine_command

    print("\n" + "\n".join(describe_benchmark(result)))
    print(f"  benchmark.json                {result['path']}")
    print(f"\ndrafter (SGLang format): {config.paths.export_dir / SGLANG_EXPORT}")
    print(
        f"serve it with its target (`eyas engine-command CONFIG --stage bench`):\n  {shlex.join(engine_command(config, 'bench'))}"
    )


def run_stage(stage: str, config) -> int:
    _, tag = start_in_process(config)
    from prefect import tags

    from eyas_cli.errors import quiet_user_error_tracebacks, raise_user_error
    from flows import bench, dataset, export, extract, train, verify

    quiet_user_error_tracebacks()

    flow_fn = {
        "dataset": dataset.build_dataset_flow,
        "extract": extract.extract_flow,
        "verify": verify.verify_flow,
        "train": train.train_flow,
        "export": export.export_flow,
        "bench": bench.bench_flow,
    }[stage]
    with tags(tag, f"config-{config.name}"):
        state = flow_fn(config, return_state=True)
    raise_user_error(state)  # a stage refused its input: its message and exit code 2
    print(
        json.dumps(
            state.result() if state.is_completed() else {"state": state.name, "message": state.message},
            indent=2,
            default=str,
        )
    )
    return 0 if state.is_completed() else 1


def looks_like_run_id(run: str) -> bool:
    try:
        uuid.UUID(run)
    except ValueError:
        return False
    return not Path(run).exists()


def no_server(api: str | None) -> str:
    return (
        f"no Prefect server answers at {api}" if api else "no Prefect server is known (none set, none started by eyas)"
    )


def show_status(run: str, as_json: bool) -> int:
    """The run's files, plus its flow runs when a Prefect server answers (none is started for this). RUN is a
    config, a workdir, or a flow-run id (whose config the server knows)."""
    from eyas.status.report import format_json, run_status
    from eyas_cli.errors import UserError
    from eyas_cli.server import check_prefect_points_at, healthy, known_api_url

    api = known_api_url()
    answers = api is not None and healthy(api)
    if answers:
        os.environ["PREFECT_API_URL"] = api  # before prefect is imported
        check_prefect_points_at(api)
    target = run
    if looks_like_run_id(run):
        if not answers:
            raise UserError(
                f"eyas status {run}: a flow-run id, but {no_server(api)} to say whose run it is; start it (or set "
                "PREFECT_API_URL), or pass the run's config or workdir instead"
            )
        from eyas.config import RunConfig
        from tasks.status import flow_run_config

        try:
            config, described = flow_run_config(run)
        except ValueError as err:
            raise UserError(f"eyas status: {err}") from None
        from eyas.status.report import RUN_CONFIG_NAME

        config = RunConfig.model_validate(config)
        print(f"flow run {run} ({described['flow']}, {described['state']}) runs workdir {config.workdir}")
        # the workdir's run.json, when there is one, gives the commands a config path to name
        target = config.workdir if (Path(config.workdir) / RUN_CONFIG_NAME).is_file() else config
    try:
        status = run_status(target, presets_dir=REPO / "deployments")
    except (OSError, ValueError) as err:
        from pydantic import ValidationError

        from eyas.config import RunConfig
        from eyas_cli.errors import format_validation_error

        text = format_validation_error(err, f"config {run}", RunConfig) if isinstance(err, ValidationError) else err
        print(f"eyas status: {text}", file=sys.stderr)
        return 2
    if answers:
        import httpx

        from tasks.status import recent_flow_runs

        try:
            status.attach_flow_runs(recent_flow_runs(status.workdir))
        except httpx.HTTPError as err:
            status.attach_flow_runs([], f"the Prefect server at {api} did not answer the flow-run query: {err}")
    else:
        status.attach_flow_runs([], f"{no_server(api)}: flow runs not shown (the stages come from files)")
    print(format_json(status) if as_json else status.to_markdown())
    return 0


def main(argv: list[str] | None = None) -> int:
    from eyas_cli.errors import guarded

    args = parse_args(argv)
    return guarded(lambda: dispatch(args), debug=args.debug)


def dispatch(args: argparse.Namespace) -> int:
    if args.command in ("demo", "run", *STAGES, "plan", "engine-command"):
        from eyas_cli.errors import user_errors_of

        config = load_config(str(DEMO_PRESET), args.workdir) if args.command == "demo" else load_config(args.config)
        with user_errors_of(config):  # an error on a path names the config field behind it
            return run_config_verb(args, config)
    return dispatch_other(args)


def run_config_verb(args: argparse.Namespace, config) -> int:
    """The verbs that take a run's config."""
    if args.command in ("demo", "run"):
        return run_pipeline(config, args.approve)
    if args.command in STAGES:
        return run_stage(args.command, config)
    if args.command == "plan":
        from eyas_cli.plan import show_plan

        return show_plan(config, args.config, args.json)
    import shlex

    from eyas_cli.engine_command import engine_command

    argv = engine_command(config, args.stage)
    out = {"stage": args.stage, "argv": argv, "command": shlex.join(argv)}
    print(json.dumps(out, indent=1) if args.json else out["command"])
    return 0


def dispatch_other(args: argparse.Namespace) -> int:
    if args.command == "worker":
        from eyas_cli.worker import run

        return run(args)
    if args.command == "deploy":
        from eyas_cli.worker import deploy

        return deploy(args.name, args.all)
    if args.command == "approve":
        from eyas_cli.approval import check_run_id

        check_run_id(args.run_id)  # before a server is started or asked
        from eyas_cli.server import connect

        connect()
        from eyas_cli.approval import approve_run

        approve_run(args.run_id, approve=not args.reject, reviewer=args.reviewer, note=args.note)  # UserError
        print(f"flow run {args.run_id}: {'rejected' if args.reject else 'approved'} by {args.reviewer}")
        return 0
    if args.command == "status":
        return show_status(args.run, args.json)
    from eyas_cli import offline

    return {"inspect": offline.run_inspect, "remap": offline.run_remap, "target": offline.show_target,
            "stop": offline.run_stop}[args.command](args)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
