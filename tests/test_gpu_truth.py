"""bench/gpu_truth.py's CPU part and scripts/gpu_wheels.py: the plan of checks and its budgets, the runner's
records (a failure, a check past its limit, one whose budget no longer fits), the JSON and exit status, the
refusal without a GPU, the Kimi shape, the wheels (versions, cache, import closure) and the device command. The
whole script at tiny shapes on the CPU (--quick) runs in tests/test_benches.py."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_flops import KIMI

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "scripts"))

import gpu_truth  # noqa: E402
import gpu_wheels  # noqa: E402
from gpu_checks.environment import GPU_TEST_FILES, pytest_counts  # noqa: E402
from gpu_checks.runner import FAILED, PASSED, SKIPPED, Check, CheckContext, run_checks  # noqa: E402
from gpu_checks.shapes import sizes  # noqa: E402


def context(tmp_path) -> CheckContext:
    return CheckContext(device="cpu", quick=False, work=tmp_path, log=lambda line: None)


def test_the_budgets_end_before_the_deadline_inside_nine_minutes():
    assert sum(c.budget_s for c in gpu_truth.PLAN) <= gpu_truth.STOP_AFTER_S <= 8.5 * 60
    assert [c.name for c in gpu_truth.PLAN] == ["environment", "gpu_tests", "decode", "parity", "memory", "speed"]


def test_a_failing_check_is_recorded_and_the_next_one_runs(tmp_path):
    def broken(ctx):
        raise ValueError("shape mismatch in the draft")

    plan = [Check("a", 5, 5, broken, "raises"), Check("b", 5, 5, lambda ctx: {"x": 1}, "passes"),
            Check("c", 5, 5, lambda ctx: {"failures": ["weights differ"]}, "fails")]  # fmt: skip
    results = run_checks(plan, context(tmp_path), stop_after_s=60)
    assert [results[n]["status"] for n in "abc"] == [FAILED, PASSED, FAILED]
    assert results["a"]["error"][-1] == "ValueError: shape mismatch in the draft"
    assert results["b"]["figures"] == {"x": 1}


def test_a_check_past_its_limit_is_stopped_and_recorded(tmp_path):
    plan = [Check("slow", 0.3, 0.3, lambda ctx: time.sleep(30), "sleeps"), Check("next", 1, 1, lambda ctx: {}, "")]
    started = time.monotonic()
    results = run_checks(plan, context(tmp_path), stop_after_s=60)
    assert time.monotonic() - started < 10
    assert results["slow"]["status"] == FAILED and "after its limit of 0 s" in results["slow"]["error"][-1]
    assert results["next"]["status"] == PASSED


def test_a_check_whose_budget_no_longer_fits_is_skipped_with_why(tmp_path):
    plan = [Check("first", 1, 1, lambda ctx: {}, ""), Check("big", 100, 100, lambda ctx: {}, "")]
    results = run_checks(plan, context(tmp_path), stop_after_s=50)
    assert results["first"]["status"] == PASSED
    assert results["big"]["status"] == SKIPPED
    assert "budget of 100 s does not fit in the" in results["big"]["reason"]


def test_the_json_and_the_exit_status_name_what_failed(tmp_path, monkeypatch, capsys):
    plan = [Check("environment", 1, 1, lambda ctx: {"device_name": "cpu"}, ""),
            Check("parity", 1, 1, lambda ctx: {"failures": ["ddp fp32: fc.weight is 3e-3 from the CPU run's"]}, "")]  # fmt: skip
    monkeypatch.setattr(gpu_truth, "PLAN", plan)
    out = tmp_path / "a folder with spaces"
    assert gpu_truth.main(["--quick", "--out", str(out)]) == 1
    report = json.loads((out / gpu_truth.JSON_FILE).read_text())
    assert report["checks_failed"] == ["parity"] and report["device_name"] == "cpu"
    assert report["checks"]["parity"]["figures"]["failures"] == ["ddp fp32: fc.weight is 3e-3 from the CPU run's"]
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["checks_failed"] == ["parity"] and "tokens_per_s" in last
    assert (out / gpu_truth.LOG_FILE).is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_without_a_gpu_the_full_run_says_so_and_exits_non_zero(tmp_path, capsys):
    assert gpu_truth.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpu_truth: no CUDA device is visible")
    assert list(tmp_path.iterdir()) == []


def test_the_full_run_is_sized_at_the_kimi_draft():
    full = sizes(quick=False)
    shape = {k: getattr(full.arch, k) for k in ("hidden_size", "num_aux", "target_vocab_size", "draft_vocab_size",
                                                 "num_attention_heads", "num_key_value_heads", "head_dim",
                                                 "intermediate_size")}  # fmt: skip
    assert shape == {k: getattr(KIMI, k) for k in shape}
    assert full.encoding.aux_dtype == "bfloat16" and full.speed_spec.draft_vocab == KIMI.draft_vocab_size
    assert max(p.length for p in full.memory_points) == full.arch.max_position_embeddings == 4096


def test_pytest_counts_reads_the_summary_line():
    assert pytest_counts("....\n3 passed, 2 skipped, 45 deselected in 12.31s\n") == {
        "passed": 3, "skipped": 2, "deselected": 45}  # fmt: skip


def test_the_wheels_are_the_versions_the_project_runs():
    assert {n: importlib.metadata.version(n) for n in gpu_wheels.WHEELS} == gpu_wheels.WHEELS


def test_what_the_gpu_run_imports_is_on_the_machine_or_among_the_wheels():
    """The third-party distributions imported by the trainer, the gpu-marked test files and gpu_truth.py."""
    modules = ["eyas.train.trainer", "gpu_truth", *(Path(f).stem for f in GPU_TEST_FILES)]
    probe = (
        "import importlib, sys, json, importlib.metadata as md\n"
        f"sys.path[:0] = {[str(REPO / 'bench'), str(REPO / 'tests'), str(REPO)]!r}\n"
        "before = set(sys.modules)\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "tops = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "found = md.packages_distributions()\n"
        "print(json.dumps(sorted({d for t in tops for d in found.get(t, [])})))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {gpu_wheels.normalized(d) for d in json.loads(done.stdout.strip().splitlines()[-1])}
    known = {gpu_wheels.normalized(d) for d in (*gpu_wheels.ON_THE_MACHINE, *gpu_wheels.WHEELS, "eyas")}
    assert sorted(imported - known) == []
    assert {gpu_wheels.normalized(n) for n in gpu_wheels.WHEELS} <= imported | {"typing_extensions"}


def fake_wheels(folder: Path, versions: dict) -> None:
    folder.mkdir()
    for name, version in versions.items():
        (folder / f"{gpu_wheels.normalized(name)}-{version}-py3-none-any.whl").write_bytes(b"")


def test_wheels_already_there_are_not_fetched_again_and_other_versions_go(tmp_path, monkeypatch):
    folder = tmp_path / "wheels"
    fake_wheels(folder, {**gpu_wheels.WHEELS, "pydantic": "2.0.0"})
    (folder / f"pydantic-{gpu_wheels.WHEELS['pydantic']}-py3-none-any.whl").write_bytes(b"")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"pip ran: {a}"))
    lines = []
    wheels = gpu_wheels.download(folder, log=lines.append)
    assert len(wheels) == len(gpu_wheels.WHEELS) and not (folder / "pydantic-2.0.0-py3-none-any.whl").exists()
    assert lines[0] == f"removing pydantic-2.0.0-py3-none-any.whl: the project runs pydantic {gpu_wheels.WHEELS['pydantic']}"


def test_a_missing_wheel_is_fetched_for_python_3_12_manylinux(tmp_path, monkeypatch):
    folder = tmp_path / "wheels"
    fake_wheels(folder, {n: v for n, v in gpu_wheels.WHEELS.items() if n != "pydantic-core"})
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **k: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    gpu_wheels.download(folder, log=lambda line: None)
    (cmd,) = calls
    assert cmd[-1] == f"pydantic-core=={gpu_wheels.WHEELS['pydantic-core']}" and "pydantic==" not in " ".join(cmd)
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert "manylinux_2_17_x86_64" in cmd


def test_the_device_command_fits_installs_offline_and_writes_under_out(capsys, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("--print-only downloaded"))
    assert gpu_wheels.main(["--print-only"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "carry: ['.gpu-wheels']"
    command = out[1].removeprefix("command: ")
    assert len(command) < 2000 and command == gpu_wheels.device_command()
    assert "--no-index --no-deps" in command and "--target /tmp/site .gpu-wheels/*.whl" in command
    assert command.endswith('python3 bench/gpu_truth.py --out "$OUT"')
    assert "'wheels with space'/*.whl" in gpu_wheels.device_command("wheels with space")
    assert ".gpu-wheels/" in (REPO / ".gitignore").read_text()


def test_a_memory_point_stopped_at_the_limit_keeps_the_points_before_it(tmp_path, monkeypatch):
    from gpu_checks import memory

    outputs = iter([json.dumps({"measured_bytes": 30 << 30})])

    def fake_run(cmd, **kwargs):
        line = next(outputs, None)
        if line is None:
            raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])
        return subprocess.CompletedProcess(cmd, 0, stdout=line + "\n", stderr="")

    monkeypatch.setattr(memory.subprocess, "run", fake_run)
    figures = memory.memory(context(tmp_path))  # the Kimi points, planned on this host's memory
    first, second = figures["points"]
    assert first["point"] == "1x2048 ddp" and first["measured_vs_planned"] == (30 << 30) / first["planned_bytes"]
    assert second["timed_out"] and figures["skipped_points"] == [p.name for p in sizes(False).memory_points[2:]]
    assert figures["peak_vs_plan_max"] == first["measured_vs_planned"] and figures["failures"] == []


def test_the_figures_a_stopped_check_had_measured_are_kept(tmp_path):
    def measures_then_hangs(ctx):
        ctx.partial["gemm_flops_per_s"] = 7.5e14
        time.sleep(30)

    results = run_checks([Check("speed", 0.3, 0.3, measures_then_hangs, "")], context(tmp_path), stop_after_s=60)
    assert results["speed"]["status"] == FAILED and results["speed"]["partial_figures"] == {"gemm_flops_per_s": 7.5e14}
