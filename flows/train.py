"""Flow `train-drafter`: smoke run, approval gate, then the multi-process trainer under torchrun.

The pipeline gates once in its own run and calls this flow with `require_approval=False`.
"""

from prefect import flow

from eyas.config import RunConfig
from eyas.dataset import tokenized_num_samples
from flows.gate import approval_gate
from tasks.status import stage_status_artifact
from tasks.train import gate_summary, launch_torchrun, preflight, smoke_run


@flow(name="train-drafter", log_prints=True)
def train_flow(config: RunConfig, require_approval: bool = True) -> dict:
    num_samples = tokenized_num_samples(config.paths.tokenized)
    if require_approval:
        smoke = smoke_run(config)
        devices = preflight(config)
        summary = gate_summary(
            config, {"dataset": {"num_samples": num_samples}}, {"mode": "not run here"}, smoke, devices
        )
        approval_gate(config, summary)
    final = launch_torchrun(config, num_samples)
    print(f"training finished: {final}")
    stage_status_artifact(config, "train")
    return final
