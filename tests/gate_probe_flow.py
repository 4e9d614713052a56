"""A flow that only gates (tasks/gate.py): tests/test_crash_vm.py deploys it to exercise the suspend path
without running the stages before the gate."""

from prefect import flow

from eyas.config import RunConfig
from tasks.gate import approval_gate


@flow(name="gate-probe", log_prints=True)
def gate_probe(config: RunConfig) -> dict:
    answer = approval_gate(config, "# probe: nothing is trained", accept_overrides=True)
    return {"approve": answer.approve, "reviewer": answer.reviewer}
