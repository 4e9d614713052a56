"""The further nodes of a training on several nodes, as flow runs of the `train-node` deployment.

The first node's launch task (tasks/train.py launch_torchrun) starts one flow run per further node
(train.node_deployment) once the job file is written, runs its own agent, and then says how each node's run ended:
a node lost while the job went on at fewer nodes (train.num_nodes 'MIN:MAX') is reported, not fatal; the job's own
failure is the trainer's. Without train.node_deployment the further nodes are started by hand (the gate shows the
command), and nothing is started here."""

from __future__ import annotations

import time
from urllib.parse import urlparse

from eyas.config import RunConfig
from eyas.facts import RunFacts
from eyas.train.node_agents import address_towards, further_nodes

REPORT_WAIT_S = 60.0


def this_node_address() -> str:
    """This machine's address on the route to the Prefect server, which every node's worker reaches too."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise ValueError(
            "train.node_deployment with train.rdzv_endpoint empty: the first node gives the further nodes its address "
            "on the route to the Prefect server, but PREFECT_API_URL is not set (a temporary server is no server the "
            "nodes share); set PREFECT_API_URL to the server every node's worker uses, or set train.rdzv_endpoint"
        )
    return address_towards(urlparse(url).hostname)


class NodeRuns:
    """The flow runs of the further nodes of one launch (none when the run trains on one node, or when its further
    nodes are started by hand)."""

    def __init__(self, config: RunConfig, facts: RunFacts):
        self.config, self.facts, self.flow_run_ids = config, facts, {}

    def start(self) -> None:
        deployment = self.config.train.node_deployment
        if not deployment:
            print(f"train.num_nodes={self.config.train.num_nodes!r} and no train.node_deployment: start the further "
                  "nodes' agents with the command above, on machines sharing the run's storage")  # fmt: skip
            return
        from prefect.context import get_run_context
        from prefect.deployments import run_deployment

        task_run = get_run_context().task_run
        for k in further_nodes(self.config):
            run = run_deployment(
                deployment,
                parameters={
                    "config": self.config.model_dump(mode="json"),
                    "facts": self.facts.model_dump(mode="json"),
                    "node_index": k,
                },
                timeout=0,
                idempotency_key=f"{task_run.id}-{task_run.run_count}-train-node-{k}",  # a relaunch starts new ones
            )
            self.flow_run_ids[k] = run.id
            print(f"node {k}: flow run {run.name} ({run.id}) of {deployment}")

    def report(self, *, wait_s: float = REPORT_WAIT_S) -> None:
        """How each further node's flow run ended (one line each), waiting up to `wait_s` for the runs still
        finishing: their agents leave when the first node's does."""
        if not self.flow_run_ids:
            return
        from prefect.client.orchestration import get_client

        deadline = time.monotonic() + wait_s
        with get_client(sync_client=True) as client:
            for k, run_id in self.flow_run_ids.items():
                state = client.read_flow_run(run_id).state
                while not state.is_final() and time.monotonic() < deadline:
                    time.sleep(1.0)
                    state = client.read_flow_run(run_id).state
                words = state.name + (f": {state.message}" if state.message else "")
                still = "" if state.is_final() else f" after {wait_s:.0f} s (its agent has not left yet)"
                print(f"node {k}: flow run {run_id} {words}{still}")
