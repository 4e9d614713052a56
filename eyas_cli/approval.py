"""Answering the approval gate from the terminal or the command line.

Prefect is imported inside the functions: `eyas approve` checks the id and points PREFECT_API_URL at eyas's
server (eyas_cli.server.connect) before Prefect reads its settings, which it does once, at import.
"""

from __future__ import annotations

import getpass
import select
import sys
import threading
import time
from pathlib import Path
from uuid import UUID


def check_run_id(run_id: str | UUID) -> UUID:
    """The flow run id as a UUID; a UserError naming the mistake otherwise."""
    from eyas_cli.errors import UserError

    try:
        return UUID(str(run_id))
    except ValueError:
        raise UserError(
            f"eyas approve {run_id}: not a flow run id; expected the UUID the waiting run printed (or `eyas status` "
            "shows), e.g. 0b6c4a3e-2f1d-4c6b-9a57-3e8f0d1c2b4a"
        ) from None


def approve_run(run_id: str | UUID, *, approve: bool, reviewer: str, note: str = "") -> None:
    """Resume a run paused at the gate; refuses a run that is not waiting."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.flow_runs import resume_flow_run

    from eyas_cli.errors import UserError

    flow_run_id = check_run_id(run_id)
    with get_client(sync_client=True) as client:
        try:
            run = client.read_flow_run(flow_run_id)
        except ObjectNotFound:
            raise UserError(
                f"eyas approve {run_id}: no flow run with this id on the Prefect server at "
                f"{client.api_url}; expected the id of a run waiting at the approval gate (the Prefect UI or "
                "`eyas status` lists them)"
            ) from None
    if run.state is None or not run.state.is_paused():
        state = run.state.name if run.state else "no state"
        raise UserError(
            f"flow run {run_id} ({run.name}) is {state}, not Paused at the approval gate; nothing to answer"
        )
    resume_flow_run(run.id, run_input={"approve": approve, "reviewer": reviewer, "note": note})


class GateWatcher(threading.Thread):
    """Follows the top-level run carrying `tag`: prints its URL, then answers its gate once.

    answer: "yes" / "no" answers by itself; None asks in the terminal when stdin is one, and
    otherwise leaves the answer to the UI or `eyas approve`.
    """

    def __init__(self, tag: str, ui_url: str, answer: str | None, summary_path: Path | None = None):
        super().__init__(daemon=True)
        self.tag, self.ui_url, self.answer = tag, ui_url, answer
        self.summary_path = summary_path  # the gate's terminal summary, printed before the question
        self.announced = False

    def run(self) -> None:
        while True:
            run = self._top_run()
            if run is not None and not self.announced:
                print(f"\nflow run: {self.ui_url}/runs/flow-run/{run.id}\n", flush=True)
                self.announced = True
            if run is not None and run.state is not None:
                if run.state.is_paused():
                    self._answer(run)
                    return
                if run.state.is_final():
                    return
            time.sleep(1.0)

    def _top_run(self):
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentTaskRunId, FlowRunFilterTags

        flt = FlowRunFilter(
            tags=FlowRunFilterTags(all_=[self.tag]), parent_task_run_id=FlowRunFilterParentTaskRunId(is_null_=True)
        )
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_run_filter=flt, limit=1)
        return runs[0] if runs else None

    def _answer(self, run) -> None:
        url = f"{self.ui_url}/runs/flow-run/{run.id}"
        if self.answer in ("yes", "no"):
            approve = self.answer == "yes"
            approve_run(
                run.id,
                approve=approve,
                reviewer=f"{getpass.getuser()} (APPROVE={self.answer})",
                note="answered by flag",
            )
            print(
                f"approval gate answered: {'approved' if approve else 'rejected'} (APPROVE={self.answer})", flush=True
            )
            return
        if self.summary_path is not None and self.summary_path.is_file():
            print(f"\n{self.summary_path.read_text()}", flush=True)
        print(
            f"The run is waiting for approval; the summary is also in the UI (Resume):\n  {url}\n"
            f"Answer below, there, or with:\n  eyas approve {run.id} [--reject]",
            flush=True,
        )
        if not sys.stdin.isatty():
            return
        reply = self._ask_unless_answered_elsewhere(run.id, "Approve training now? [y/N] ")
        if reply is None:
            print("\n(the gate was answered elsewhere)", flush=True)
            return
        approve_run(run.id, approve=reply in ("y", "yes"), reviewer=getpass.getuser(), note="answered in the terminal")

    def _ask_unless_answered_elsewhere(self, run_id, prompt: str) -> str | None:
        """Read a line from the terminal; None once the run is no longer paused (UI or `eyas approve`)."""
        from prefect.client.orchestration import get_client

        print(prompt, end="", flush=True)
        while True:
            readable, _, _ = select.select([sys.stdin], [], [], 1.0)
            if readable:
                return sys.stdin.readline().strip().lower()
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(run_id).state
            if state is None or not state.is_paused():
                return None
