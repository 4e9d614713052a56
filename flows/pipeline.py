"""Flow `pipeline`: dataset -> extract -> verify -> smoke run -> approval gate -> train -> export -> benchmark.

With train.start='streaming': dataset -> extract and verify the smoke run's shards -> smoke run -> approval gate
-> extraction (the `extract-stream` flow) and training at once -> export -> benchmark. With extract.stream_deployment
the extraction is a flow run of that deployment (another work pool, sharing only storage and the Prefect server),
started once the approval is given, and a run of it that ends Crashed is followed by a new one (tasks/stream.py
follow_producer); the smoke run's shards are extracted here, before the gate, so that nothing runs on the
producer's pool before the approval.
A trainer that fails leaves the extraction running to its end, then the run fails with the trainer's reason; an
extraction that fails stops the trainer as `eyas stop` does (every rank after the same step, a checkpoint there; a launcher whose
ranks wait for a shard is signalled after the stop's wait), then the run fails with the extraction's reason.
Running the pipeline again resumes both.

Run from a deployment, the gate suspends the run (no process held) and the worker runs it again
from the top once answered: every stage before the gate comes back from cache (tasks/caching.py)
or from its durable state (the extraction manifest). Training resumes from its newest complete
checkpoint. The reviewer's overrides apply to the training run only (eyas.gate.approval).
"""

from prefect import flow

from eyas.config import RunConfig
from eyas.gate.approval import apply_overrides
from eyas.run_inputs import STAGES
from flows.bench import bench_flow
from flows.dataset import build_dataset_flow
from flows.export import export_flow
from flows.extract import extract_flow
from flows.stream import extract_stream_flow
from flows.train import train_flow
from flows.verify import verify_flow
from tasks.attempts import settle_earlier_attempts
from tasks.facts import check_run_inputs, resolve_run_facts
from tasks.gate import approval_gate, gate_summary
from tasks.stream import extract_stream, follow_producer, smoke_shards, stop_training
from tasks.train import launch_torchrun, preflight, smoke_run


@flow(name="pipeline", log_prints=True)
def pipeline(config: RunConfig) -> dict:
    """The whole run: dataset, extraction, verification, smoke run, approval gate, training, export, benchmark."""
    settle_earlier_attempts()  # a retry: what the crashed attempt left Running is marked Crashed
    check_run_inputs(config, list(STAGES))  # every stage's inputs, before the first answer is generated
    dataset = build_dataset_flow(config)
    facts = resolve_run_facts(config)
    if config.train.start == "streaming":
        return streamed(config, facts, dataset)
    extract_flow(config, facts)
    verified = verify_flow(config, facts)
    devices = preflight(config, facts)  # before the smoke run: a GPU run's smoke runs on a training device
    smoke = smoke_run(config, facts)
    summary = gate_summary(config, facts, dataset["dataset"], verified, smoke, devices)
    approval = approval_gate(config, summary, num_samples=facts.num_samples, accept_overrides=True)
    train_flow(apply_overrides(config, approval.overrides()), facts, require_approval=False)
    export_dir = export_flow(config)
    return bench_flow(config, export_dir)


def streamed(config: RunConfig, facts, dataset: dict) -> dict:
    """train.start='streaming' after the dataset: the gate on the smoke run's shards, then extraction and training
    together (see the module docstring for a failure of either side)."""
    extracted = extract_stream(config, facts, only=smoke_shards(config, facts))
    devices = preflight(config, facts)
    smoke = smoke_run(config, facts)
    verified = {"mode": f"{config.verify.mode}, each shard on arrival, before any rank reads it"}
    summary = gate_summary(config, facts, dataset["dataset"], verified, smoke, devices, extracted=extracted)
    approval = approval_gate(config, summary, num_samples=facts.num_samples, accept_overrides=True)
    train_while_extracting(apply_overrides(config, approval.overrides()), config, facts)
    export_dir = export_flow(config)
    return bench_flow(config, export_dir)


def train_while_extracting(approved: RunConfig, config: RunConfig, facts) -> None:
    """After the gate of a streamed run: the trainer (the `approved` config, with the reviewer's overrides) and the
    producer (`config`) at once; the producer's failure stops the trainer, then raises."""
    training = launch_torchrun.submit(approved, facts)
    try:
        if config.extract.stream_deployment:  # a flow run of its own work pool, sharing storage and the server
            follow_producer(config, facts)
        else:
            extract_stream_flow(config, facts)
    except Exception:
        stop_training(config, training)  # its ranks would wait for shards that no producer writes
        raise
    training.result()
