"""The README's operating commands run as written after `make demo` or `make test`.

The block of commands in "Presets and work pools" is read from the README itself. Every command in it names an
executable the project installs (`.venv/bin/...`); the safe ones run here, word for word, against the test's
Prefect server: `eyas worker --setup-only` (the pool, the automation) and `eyas deploy --name '*-tiny-cpu'`
(deployments on the server, and the hint that names eyas's worker rather than Prefect's plain one). The
rest need a cluster or start a long-running worker; they are only checked to exist.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAFE = (".venv/bin/eyas worker --setup-only", ".venv/bin/eyas deploy --name '*-tiny-cpu'")


def operating_commands() -> list[str]:
    """The commands of the README's fenced block that starts the worker (comments and continuations joined)."""
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"^```\n(.*?)^```$", text, re.S | re.M)
    [block] = [b for b in blocks if "eyas worker --setup-only" in b]
    joined = block.replace("\\\n", " ")
    commands = [line.split("  #", 1)[0].strip() for line in joined.splitlines()]
    return [" ".join(c.split()) for c in commands if c]


def test_every_operating_command_is_the_projects_own():
    commands = operating_commands()
    assert set(SAFE) <= set(commands), commands
    for command in commands:
        executable = shlex.split(command)[0]
        assert executable.startswith(".venv/bin/"), f"{command!r}: not the project's environment"
        assert (REPO / executable).is_file(), f"{command!r}: {executable} is not installed by `make install`"
    # nowhere does the README tell a user to run bare `python -m eyas_cli...` or `prefect ...` (it may quote what
    # Prefect itself suggests)
    readme = (REPO / "README.md").read_text()
    bare = re.findall(
        r"(?<!suggesting )`(?:python -m eyas_cli|prefect (?:deploy|worker|flow-run|work-pool))[^`]*`", readme
    )
    assert not bare, bare


def test_the_safe_operating_commands_run_as_written(prefect_server, removes_crash_automation, tmp_path):
    from prefect.client.orchestration import get_client

    env = {**os.environ, "EYAS_STATE_DIR": str(tmp_path / "state")}
    outputs = {}
    for command in SAFE:
        proc = subprocess.run(command, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        outputs[command] = proc.stdout
    assert "work pool 'eyas-local'" in outputs[SAFE[0]] and "PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30" in outputs[SAFE[0]]
    hint = outputs[SAFE[1]]
    assert "not the plain `prefect worker start`" in hint and ".venv/bin/eyas worker" in hint, hint[-2000:]
    with get_client(sync_client=True) as client:
        names = {d.name for d in client.read_deployments()}
        automations = [a.name for a in client.read_automations()]
    assert {"pipeline-tiny-cpu", "train-drafter-tiny-cpu", "benchmark-acceptance-tiny-cpu"} <= names, names
    assert not any(n.endswith("8gpu") for n in names), names  # only the pattern's deployments
    assert automations, "eyas worker --setup-only installed no crash automation"
