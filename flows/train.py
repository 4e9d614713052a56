"""Flow `train-drafter`: device preflight, smoke run, approval gate, then the multi-process trainer under torchrun.

The pipeline gates once in its own run and calls this flow with `require_approval=False`.
"""

from prefect import flow

from eyas.config import RunConfig
from eyas.facts import RunFacts
from tasks.attempts import settle_earlier_attempts
from tasks.facts import check_run_inputs, resolve_run_facts
from tasks.gate import approval_gate, gate_summary
from tasks.status import stage_status_artifact
from tasks.train import launch_torchrun, node_agent, preflight, smoke_run


@flow(name="train-drafter", log_prints=True)
def train_flow(config: RunConfig, facts: RunFacts | None = None, require_approval: bool = True) -> dict:
    """Train the draft under torchrun, resuming from the newest complete checkpoint; alone, it asks for approval
    first (device preflight, smoke run, the gate).

    `facts`: the run's resolved facts, which the pipeline passes; left empty, the flow resolves them."""
    settle_earlier_attempts()  # a retry of this flow's own run (a subflow of a retried pipeline is a new run)
    if facts is None:  # run alone: its inputs are checked first (the pipeline checks every stage's at its start)
        check_run_inputs(config, ["train"])
        facts = resolve_run_facts(config)
    if require_approval:
        devices = preflight(config, facts)  # before the smoke run: a GPU run's smoke runs on a training device
        smoke = smoke_run(config, facts)
        dataset = {"num_samples": facts.num_samples}
        summary = gate_summary(config, facts, dataset, {"mode": "not run here"}, smoke, devices)
        approval_gate(config, summary, num_samples=facts.num_samples)
    final = launch_torchrun(config, facts)
    print(f"training finished at step {final['step']:,} (loss {final['final_loss']:.4f}): {final['checkpoint']}")
    stage_status_artifact(config, "train")
    return final


@flow(name="train-node", log_prints=True)
def train_node_flow(config: RunConfig, facts: RunFacts, node_index: int) -> dict:
    """One further node of a training on several nodes: its torchrun agent joins the first node's rendezvous.
    Started by the training flow (train.node_deployment), one flow run per further node."""
    return node_agent(config, facts, node_index)
