"""Flow `pipeline`: dataset -> extract -> verify -> smoke run -> approval gate -> train -> export -> benchmark.

Run from a deployment, the gate suspends the run (no process held) and the worker runs it again
from the top once answered: every stage before the gate comes back from cache (tasks/caching.py)
or from its durable state (the extraction manifest). Training resumes from its newest complete
checkpoint. The reviewer's overrides apply to the training run only (eyas.approval).
"""

from prefect import flow

from eyas.approval import apply_overrides
from eyas.config import RunConfig
from flows.bench import bench_flow
from flows.dataset import build_dataset_flow
from flows.export import export_flow
from flows.extract import extract_flow
from flows.gate import approval_gate
from flows.train import train_flow
from flows.verify import verify_flow
from tasks.train import gate_summary, preflight, smoke_run


@flow(name="pipeline", log_prints=True)
def pipeline(config: RunConfig) -> dict:
    dataset = build_dataset_flow(config)
    extract_flow(config)
    verified = verify_flow(config)
    smoke = smoke_run(config)
    devices = preflight(config)
    summary = gate_summary(config, dataset, verified, smoke, devices)
    approval = approval_gate(config, summary, accept_overrides=True)
    train_flow(apply_overrides(config, approval.overrides()), require_approval=False)
    export_dir = export_flow(config)
    return bench_flow(config, export_dir)
