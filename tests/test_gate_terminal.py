"""The gate in a terminal: `eyas demo` prints the decision, laid out for 80 columns, before it asks; "n" rejects.

The real command runs in a pseudo-terminal (so its stdin is a terminal and the gate asks there) against the
test's Prefect server, up to the gate; the test answers "n". It runs from a copy of the checkout in a directory
whose 40-character name holds a space (as CI systems and worktree setups name them), through an interpreter path
there too: nothing the terminal shows may depend on where the repository lies. A unit case lays out a 1T
target's draft (H 7168) and checks the width and the figures.
"""

from __future__ import annotations

import os
import pty
import re
import select
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyas.config import load_run_config
from eyas.gate.summary import TERMINAL_WIDTH, duration_text, review, terminal_text

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Approve training now? [y/N]"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
CHECKOUT_NAME = "a checkout 0123456789abcdef0123456789abc"  # 40 characters, one of them a space


def words(line: str) -> list[str]:
    """The line's words as the shell reads them (a quoted path with a space is one), or as prose."""
    try:
        return shlex.split(line.strip().removesuffix("\\"))
    except ValueError:  # an apostrophe in prose
        return line.split()


def too_wide(text: str) -> list[str]:
    """Lines wider than the terminal, except a command line holding one argument that no line could hold."""
    return [line for line in text.splitlines() if len(line) > TERMINAL_WIDTH and len(words(line)) > 1]


def shell_arguments(lines: list[str]) -> list[str]:
    """The arguments bash reads from the lines pasted after a command name, backslash-newlines and all."""
    script = "printf '%s\\0' " + "\n".join(lines)
    out = subprocess.run(["bash", "-c", script], capture_output=True, check=True).stdout
    return [arg.decode() for arg in out.split(b"\0")[:-1]]


def copy_checkout(dest: Path) -> Path:
    """The working tree as git sees it (tracked and new files, no ignored ones) copied to dest, with a `.venv`
    that links this interpreter's environment; returns the interpreter path inside dest."""
    ls_files = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    listed = subprocess.run(ls_files, cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (REPO / name).is_file():  # a tracked file deleted from the working tree is not there
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    if sys.prefix == sys.base_prefix:  # not in a virtual environment: the interpreter stays where it is
        return Path(sys.executable)
    (dest / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    return dest / ".venv" / "bin" / Path(sys.executable).name


def read_until(fd: int, needle: str, timeout_s: float, seen: list[str]) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            seen.append(chunk.decode(errors="replace"))
            text = ANSI.sub("", "".join(seen)).replace("\r\n", "\n")
            if needle in text:
                return text
    raise AssertionError(f"{needle!r} never appeared; the output ended with:\n{''.join(seen)[-3000:]}")


@pytest.mark.e2e
@pytest.mark.timeout(1500)
def test_eyas_demo_prints_the_decision_before_it_asks_and_n_rejects(prefect_server, removes_crash_automation, tmp_path):
    checkout = tmp_path / CHECKOUT_NAME
    python = copy_checkout(checkout)
    workdir = checkout / "runs" / "demo"
    controller, terminal = pty.openpty()
    path = os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))  # the copy's code, not ours
    env = {**os.environ, "COLUMNS": str(TERMINAL_WIDTH), "APPROVE": "", "PYTHONPATH": path}
    proc = subprocess.Popen(
        [str(python), "-m", "eyas_cli.main", "demo", "--workdir", str(workdir)],
        cwd=checkout,
        env=env,
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        start_new_session=True,
    )
    os.close(terminal)
    seen: list[str] = []
    try:
        text = read_until(controller, PROMPT, 1200, seen)
        before = text[: text.index(PROMPT)]
        summary = before[before.index("Approve training of") : before.index("The run is waiting")]
        assert not too_wide(before[before.index("The run is waiting") :])
        print(summary)
        # what trains and what is frozen, with counts and shapes, and the totals
        assert re.search(r"^  embed_tokens\s+[\d,]+\s+FROZEN\s+\[\d+, 128\]$", summary, re.M), summary
        assert re.search(r"^  fc\s+[\d,]+\s+yes\s+\[128, 384\]$", summary, re.M), summary
        totals = re.search(r"^  total: ([\d,]+) trainable, ([\d,]+) frozen$", summary, re.M)
        assert totals and int(totals[1].replace(",", "")) > 0 and int(totals[2].replace(",", "")) > 0
        # the data, the smoke run, the estimate from the smoke run's speed, the command
        assert re.search(r"^Data\s+[\d,]+ samples, [\d,]+ tokens", summary, re.M), summary
        assert re.search(r"(\d+) of\s+\1 shards\s+verified", summary), summary
        assert re.search(r"^Smoke\s+loss [\d.]+ -> [\d.]+ in \d+ steps on \d+ samples: passed$", summary, re.M)
        estimate = re.search(r"^Estimate\s+about [\d.]+ (s|min|h) wall, [\d.]+ CPU process-hours", summary, re.M)
        assert estimate, summary
        assert "at the smoke run's" in summary and "tokens/s each" in summary
        # the command block, pasted into a shell, is the very command, whatever the paths hold
        command = summary.strip().split("\nCommand\n", 1)[1].splitlines()
        nproc = load_run_config(checkout / "deployments" / "tiny-cpu.json").train.num_processes
        assert shell_arguments(command) == [
            str(python), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "eyas.train", "--config", str(workdir / "train" / "job.json"),
        ], command  # fmt: skip
        assert not too_wide(summary), too_wide(summary)
        assert (workdir / "gate-summary.txt").read_text().strip() == summary.strip()

        os.write(controller, b"n\n")
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            select.select([controller], [], [], 1.0)
            try:
                seen.append(os.read(controller, 65536).decode(errors="replace"))
            except OSError:
                break
        assert proc.wait(timeout=30) == 1, "".join(seen)[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        os.close(controller)
    tail = ANSI.sub("", "".join(seen))
    assert "training rejected by" in tail, tail[-3000:]
    assert not (workdir / "train" / "job.json").exists() and not (workdir / "approval.json").exists()
    assert (workdir / "rejection.json").is_file()


def test_a_1t_targets_decision_fits_80_columns(tmp_path):
    """Kimi-K2.5's shapes (H 7168, vocab 163,840, draft vocab 32,000) and a long workdir: every line fits."""
    from eyas.facts import RunFacts, TargetFacts

    config = load_run_config(REPO / "deployments" / "kimi-k25-8gpu.json")
    config = config.model_copy(update={"workdir": str(tmp_path / "a-workdir")})
    h, v, d = 7168, 163840, 32000
    modules = [
        {"module": "embed_tokens", "num_params": v * h, "shapes": {"weight": [v, h]}, "trainable": False},
        {"module": "fc", "num_params": 3 * h * h, "shapes": {"weight": [h, 3 * h]}, "trainable": True},
        {
            "module": "midlayer.self_attn",
            "num_params": 4 * 2 * h * h,
            "shapes": {f"{p}_proj.weight": [h, 2 * h] for p in "qkvo"},
            "trainable": True,
        },
        {"module": "lm_head", "num_params": d * h, "shapes": {"weight": [d, h]}, "trainable": True},
    ]
    smoke = {
        "first_loss": 10.5,
        "last_loss": 3.25,
        "steps": 40,
        "samples": 8,
        "passed": True,
        "tokens_per_s": 20000.0,
        "device": "cpu",
        "modules": modules,
    }
    facts = RunFacts.model_construct(
        target=TargetFacts.model_construct(hidden_size=h, vocab_size=v),
        aux_layer_ids=[2, 30, 58],
        tokenized_path="",
        dataset_hash="",
        num_samples=37000,
        shards_dir="",
        storage_url="",
    )
    lengths = [2373] * 37000
    object.__setattr__(facts, "sample_lengths", lambda: lengths)
    r = review(
        config,
        facts,
        dataset={"num_tokens": 87_800_000, "num_loss_tokens": 40_000_000},
        verified={"mode": "cheap", "shards": 4000, "ok": 4000},
        smoke=smoke,
        devices={"backend": "nccl", "num_processes": 8, "ok": True, "devices": []},
    )
    text = terminal_text(r)
    print(text)
    assert not too_wide(text), too_wide(text)
    assert "FROZEN" in text.splitlines()[4]
    assert f"total: {3 * h * h + 8 * h * h + d * h:,} trainable, {v * h:,} frozen" in text
    # the smoke run measured CPU speed, training runs on CUDA: no wall-time figure rather than a wrong one
    assert "no wall-time figure: the smoke run measured 20,000 tokens/s on cpu, and training runs on cuda" in " ".join(
        text.split()
    )
    # on the same kind of device the estimate scales the measured speed
    r = review(
        config,
        facts,
        dataset={},
        verified={"mode": "cheap", "shards": 4000, "ok": 4000},
        smoke={**smoke, "device": "cuda:0"},
        devices={"backend": "nccl", "num_processes": 8, "ok": True, "devices": []},
    )
    t = config.train
    num_train = 37000 - round(37000 * t.eval_fraction)  # the held-out split is not trained on
    assert t.eval_fraction > 0 and num_train < 37000
    steps = num_train // t.global_batch_size * t.num_epochs  # each epoch's tail (< one batch) is skipped
    tokens = steps * t.global_batch_size * 2373  # every sample fits draft.max_position_embeddings
    assert config.draft.max_position_embeddings >= 2373 and not t.max_steps
    wall_s = tokens / (20000 * t.num_processes)
    assert r["estimate"].startswith(
        f"about {duration_text(wall_s)} wall, {wall_s * t.num_processes / 3600:.2f} GPU-hours ("
        f"{steps:,} steps, {tokens:,} tokens on {t.num_processes} processes"
    ), r["estimate"]


@pytest.mark.parametrize("width,split_words", [(78, False), (44, True), (30, True), (20, True)])
def test_a_wrapped_command_runs_as_the_command(width, split_words):
    """bash joins the wrapped lines back into the very arguments, whatever the paths hold: a checkout under a
    40-character name with a space (each piece of a split quoted word is quoted on its own), an apostrophe, a
    component longer than the line (split inside itself, a backslash-newline joining it again)."""
    from eyas.train.launch import wrap_command

    root = f"/tmp/ci-builds/{CHECKOUT_NAME}"
    cmd = [f"{root}/.venv/bin/python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8",
           "-m", "eyas.train", "--config", f"{root}/runs/a-rather-long-directory-name/train/job.json",
           "/mnt/eyas/runs/kimi-k25-8gpu/job.json", "it's q/x y", "x" * 2 * width]  # fmt: skip
    lines = wrap_command(cmd, width, split_words=split_words)
    assert shell_arguments(lines) == cmd, lines
    if split_words:
        assert max(map(len, lines)) <= width, lines
    else:  # a line of its own for an argument no line could hold, never a split one
        assert all(len(words(line)) == 1 for line in lines if len(line) > width), lines
        assert all(line.endswith(" \\") for line in lines[:-1]), lines


def test_a_split_path_breaks_after_a_slash_where_it_can():
    from eyas.train.launch import wrap_command

    cmd = ["python", "--config", "/mnt/eyas/runs/kimi-k25-8gpu/a-rather-long-directory-name/train/job.json"]
    assert wrap_command(cmd, 44, split_words=True) == [
        "python --config \\",
        "    /mnt/eyas/runs/kimi-k25-8gpu/\\",
        "a-rather-long-directory-name/train/\\",
        "job.json",
    ]
