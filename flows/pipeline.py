"""Flow `pipeline`: dataset -> extract -> verify -> smoke run -> approval gate -> train -> export -> benchmark."""

from prefect import flow

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
    approval_gate(config, gate_summary(config, dataset, verified, smoke, devices))
    train_flow(config, require_approval=False)
    export_dir = export_flow(config)
    return bench_flow(config, export_dir)
