"""Device preflight (the devices torch sees, the memory plan on them) and the registry of processes eyas starts."""

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from run_fixtures import REPO

from eyas.config import TrainConfig, load_run_config
from eyas.train.devices import MIB, DeviceQueryFailed, query_devices
from eyas.train.preflight import (
    PreflightFailed,
    alive_recorded,
    device_preflight,
    preflight_run,
    read_registry,
    record_launch,
    stop_recorded,
)

H200_MIB = 143771  # torch's total memory of an H200
KIMI_FACTS = SimpleNamespace(target=SimpleNamespace(hidden_size=7168, vocab_size=163840))  # what the plan reads


def gpu(index, *, used=500, total=H200_MIB, name="NVIDIA H200", capability="9.0"):
    """A row of eyas.train.devices' query."""
    return {
        "device": f"cuda:{index}",
        "name": name,
        "capability": capability,
        "bf16": float(capability) >= 8.0,
        "memory_total_mib": total,
        "memory_free_mib": total - used,
        "memory_used_mib": used,
    }


def found(*rows, visible=None, cuda="13.0", nccl=True, reason="", errors=None):
    """What eyas.train.devices' query returns."""
    return {
        "cuda_visible_devices": visible,
        "torch": "2.11.0+cu130" if cuda else "2.13.0+cpu",
        "cuda": cuda,
        "cuda_available": bool(rows),
        "unavailable_reason": reason,
        "nccl_available": nccl,
        "nccl_version": "2.27.7" if nccl else "",
        "devices": list(rows),
        "device_errors": errors or {},
    }


def nccl(num_processes=2, **train):
    return TrainConfig(num_processes=num_processes, backend="nccl", **train)


def kimi(tmp_path, **train):
    config = load_run_config(REPO / "deployments" / "kimi-k25-8gpu.json")
    return config.model_copy(update={"workdir": str(tmp_path), "train": config.train.model_copy(update=train)})


def test_cpu_preflight_reports_gloo_and_passes(tmp_path):
    report = device_preflight(TrainConfig(num_processes=2, backend="gloo"), tmp_path)
    assert report.ok and report.devices[0]["device"] == "cpu" and report.devices[0]["processes"] == 2


def test_idle_gpus_pass_and_the_report_keeps_torchs_rows(tmp_path):
    report = device_preflight(nccl(2), tmp_path, found(gpu(0), gpu(1), gpu(2, used=90000), visible="4,5,6"))
    assert report.ok
    assert [(d["device"], d["used"], d["busy"]) for d in report.devices] == [
        ("cuda:0", True, False),
        ("cuda:1", True, False),
        ("cuda:2", False, False),  # no rank uses it: its memory is not checked
    ]
    assert report.torch == {
        "torch": "2.11.0+cu130",
        "cuda": "13.0",
        "nccl_version": "2.27.7",
        "cuda_visible_devices": "4,5,6",
    }
    assert json.loads(json.dumps(report.to_dict()))["devices"][0]["name"] == "NVIDIA H200"


def test_busy_gpu_is_refused_with_its_memory(tmp_path):
    report = device_preflight(nccl(2, max_idle_gpu_memory_mib=1024), tmp_path, found(gpu(0), gpu(1, used=40211)))
    assert report.problems == [
        "cuda:1 (NVIDIA H200): 40211 MiB of 143771 MiB already in use, expected at most "
        "train.max_idle_gpu_memory_mib=1024; another job holds this GPU: stop it, or expose idle GPUs with "
        "CUDA_VISIBLE_DEVICES"
    ]
    assert [d["busy"] for d in report.devices] == [False, True]


def test_too_few_gpus_is_refused_naming_those_torch_sees(tmp_path):
    report = device_preflight(nccl(8), tmp_path, found(gpu(0), gpu(1), visible="2,3"))
    assert report.problems == [
        "train.num_processes=8 but torch sees 2 GPU(s) (CUDA_VISIBLE_DEVICES='2,3'): cuda:0 (NVIDIA H200), "
        "cuda:1 (NVIDIA H200); expose more GPUs with CUDA_VISIBLE_DEVICES or lower train.num_processes"
    ]


def test_a_gpu_without_bf16_is_refused_for_a_bf16_run_and_accepted_in_fp32(tmp_path):
    v100 = found(gpu(0, name="Tesla V100-SXM2-32GB", capability="7.0", total=32510))
    assert device_preflight(nccl(1), tmp_path, v100).problems == [
        "cuda:0 (Tesla V100-SXM2-32GB): compute capability 7.0, expected 8.0 or higher for bf16 "
        "(train.mixed_precision='auto' trains in bf16 on CUDA); use bf16-capable GPUs (Ampere or newer: A100, H100, "
        "H200) via CUDA_VISIBLE_DEVICES, or set train.mixed_precision='off' (fp32: slower, and a larger memory plan)"
    ]
    assert device_preflight(nccl(1, mixed_precision="off"), tmp_path, v100).ok


def test_a_gpu_whose_memory_torch_cannot_read_is_refused(tmp_path):
    row = {**gpu(1), "memory_free_mib": None, "memory_used_mib": None}
    report = device_preflight(nccl(2), tmp_path, found(gpu(0), row, errors={"cuda:1": "CUDA error: busy"}))
    assert report.problems == [
        "cuda:1 (NVIDIA H200): torch could not read its free memory (CUDA error: busy), expected a device this run "
        "can use; another process may hold it in exclusive mode (`nvidia-smi` shows it): stop it, or expose other "
        "GPUs with CUDA_VISIBLE_DEVICES"
    ]


def test_torch_without_nccl_is_refused(tmp_path):
    assert device_preflight(nccl(1), tmp_path, found(gpu(0), nccl=False)).problems == [
        "torch 2.11.0+cu130 reports no NCCL (torch.distributed.is_nccl_available() is False), expected for "
        "train.backend='nccl'; install torch's CUDA build for Linux (its wheels bundle NCCL), or use "
        "train.backend='gloo'"
    ]


@pytest.mark.parametrize(
    ("query", "problem"),
    [
        (
            found(cuda=None, nccl=False),
            "no CUDA device is visible to torch: torch 2.13.0+cpu is a CPU-only build, expected a CUDA build for "
            "train.backend='nccl'; install torch's CUDA build on a machine with NVIDIA GPUs, or use "
            "train.backend='gloo' on CPU",
        ),
        (
            found(visible=""),
            "no CUDA device is visible to torch 2.11.0+cu130 (CUDA 13.0) with CUDA_VISIBLE_DEVICES=''; list the GPUs "
            "to train on there (their indices or UUIDs, as `nvidia-smi -L` shows them), or unset it",
        ),
        (
            found(reason="CUDA initialization: Found no NVIDIA driver on your system."),
            "no CUDA device is visible to torch 2.11.0+cu130 (CUDA 13.0): CUDA initialization: Found no NVIDIA "
            "driver on your system.; check that `nvidia-smi` lists the GPUs and that the driver supports CUDA 13.0, "
            "or use train.backend='gloo' on CPU",
        ),
    ],
    ids=["cpu-only torch", "all hidden", "no driver"],
)
def test_no_visible_device_is_one_problem_naming_the_fix(tmp_path, query, problem):
    assert device_preflight(nccl(2), tmp_path, query).problems == [problem]


def test_the_real_query_on_a_machine_without_gpus_gives_the_no_cuda_device_problem(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    report = device_preflight(nccl(2), tmp_path)
    assert len(report.problems) == 1 and report.problems[0].startswith("no CUDA device is visible to torch")
    assert report.devices == [] and report.torch["torch"] == torch.__version__


def test_the_query_subprocess_sees_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert query_devices()["cuda_visible_devices"] == "3,5"


def test_a_crashed_query_is_one_problem_with_its_last_error_line(tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\necho 'Traceback (most recent call last):' >&2\n"
        "echo 'ImportError: libcudart.so.13: cannot open shared object file' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    assert device_preflight(nccl(1), tmp_path).problems == [
        f"the device query `{fake} -m eyas.train.devices` exited with 1 and no result, expected one JSON line: "
        f"ImportError: libcudart.so.13: cannot open shared object file; run it by hand to see the whole error "
        f"(does torch import in this environment?)"
    ]


def test_a_hung_query_is_stopped_and_reported(tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    with pytest.raises(DeviceQueryFailed, match=r"did not finish within 0.5 s, expected a few seconds; the NVIDIA"):
        query_devices(timeout_s=0.5)


def test_the_plan_is_made_for_the_smallest_gpu_a_rank_uses_and_recorded(tmp_path):
    config = kimi(tmp_path, device_memory_gib=0)
    rows = [gpu(i) for i in range(8)] + [gpu(8, total=81559)]  # cuda:8 is visible but unused
    rows[3] = gpu(3, total=H200_MIB - 1024)
    report = preflight_run(config, KIMI_FACTS, found=found(*rows))
    assert report.plan["device_bytes"] == (H200_MIB - 1024) * MIB and report.plan["fits"]
    assert report.plan["micro_batch_tokens"] == 4096 and 0 < report.plan["peak_bytes"] < report.plan["usable_bytes"]
    assert json.loads(json.dumps(report.to_dict()))["plan"] == report.plan


def test_a_plan_that_does_not_fit_the_smallest_gpu_is_refused_naming_it(tmp_path):
    config = kimi(tmp_path, device_memory_gib=0, parallelism="ddp", max_tokens_per_micro_batch=32768)
    rows = [gpu(i) for i in range(7)] + [gpu(7, name="NVIDIA A100-SXM4-80GB", capability="8.0", total=81559)]
    with pytest.raises(PreflightFailed) as failed:
        preflight_run(config, KIMI_FACTS, found=found(*rows))
    message = str(failed.value)
    assert message.startswith(
        "device preflight failed:\n- memory plan against cuda:7 (NVIDIA A100-SXM4-80GB), the smallest device a rank "
        "uses: training needs"
    )
    assert "fixes: a smaller train.max_tokens_per_micro_batch" in message


def test_a_gpu_without_the_plans_peak_free_is_refused(tmp_path):
    config = kimi(tmp_path, max_idle_gpu_memory_mib=200_000)  # sharing allowed: only the plan's peak must fit
    rows = [gpu(i) for i in range(8)]
    rows[5] = gpu(5, used=120_000)
    with pytest.raises(PreflightFailed) as failed:
        preflight_run(config, KIMI_FACTS, found=found(*rows))
    assert str(failed.value) == (
        "device preflight failed:\n- cuda:5 (NVIDIA H200): 23.2 GiB free of 140.4 GiB, expected at least the memory "
        "plan's peak of 30.9 GiB per device (micro-batches of 4,096 tokens); free the 120000 MiB in use, expose GPUs "
        "with more memory via CUDA_VISIBLE_DEVICES, or shrink the plan: train.activation_checkpointing=true (each "
        "unroll step recomputed in the backward); fewer tokens per sample (draft.max_position_embeddings / "
        "dataset.max_length, now 4096)"
    )


def test_a_device_memory_gib_larger_than_the_gpus_is_named_among_the_fixes(tmp_path):
    config = kimi(tmp_path)  # the preset plans an H200 (device_memory_gib 139.8)
    l4 = [gpu(i, name="NVIDIA L4", capability="8.9", total=22563) for i in range(8)]
    with pytest.raises(PreflightFailed) as failed:
        preflight_run(config, KIMI_FACTS, found=found(*l4))
    problems = str(failed.value).splitlines()[1:]
    assert len(problems) == 8
    assert problems[0].startswith("- cuda:0 (NVIDIA L4): 21.5 GiB free of 22.0 GiB, expected at least")
    assert "shrink the plan: train.device_memory_gib=0 (now 139.8, more than this GPU); " in problems[0]


def test_a_cpu_run_records_its_plan(tmp_path):
    config = load_run_config(REPO / "deployments" / "tiny-cpu.json").model_copy(update={"workdir": str(tmp_path)})
    facts = SimpleNamespace(target=SimpleNamespace(hidden_size=64, vocab_size=512))
    report = preflight_run(config, facts)
    assert report.devices[0]["device"] == "cpu" and report.plan["fits"]


def test_recorded_launcher_still_alive_fails_preflight_and_is_stopped(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        record_launch(tmp_path, proc.pid, ["torchrun", "-m", "eyas.train"])
        report = device_preflight(TrainConfig(backend="gloo"), tmp_path)
        assert not report.ok and f"process {proc.pid} started by an earlier eyas launch" in report.problems[0]
        assert stop_recorded(tmp_path, grace_s=5) == [proc.pid]
        assert proc.wait(timeout=10) != 0
        assert alive_recorded(tmp_path) == []
        assert device_preflight(TrainConfig(backend="gloo"), tmp_path).ok
    finally:
        proc.kill()


def test_a_reused_pid_is_not_taken_for_the_recorded_process(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        record_launch(tmp_path, proc.pid, ["torchrun"])
        entries = read_registry(tmp_path)
        entries[0]["start_time"] -= 1  # as if the PID now belonged to a later process
        (tmp_path / "processes.json").write_text(json.dumps(entries))
        assert alive_recorded(tmp_path) == []
        assert stop_recorded(tmp_path, grace_s=1) == []
        time.sleep(0.2)
        assert proc.poll() is None  # an unrelated process is never signalled
    finally:
        proc.kill()


def test_eyas_stop_stops_the_recorded_launcher(tmp_path, capsys):
    from eyas_cli.main import main

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        record_launch(tmp_path, proc.pid, ["torchrun", "-m", "eyas.train"])
        assert main(["stop", str(tmp_path)]) == 0
        lines = capsys.readouterr().out.splitlines()  # no node reports for it: stopped at once, as a signal
        assert f"stopped [{proc.pid}] with SIGTERM (SIGKILL after 10 s): not ended on its own" in lines
        assert proc.wait(timeout=15) != 0
        assert main(["stop", str(tmp_path)]) == 0
        assert "no process recorded" in capsys.readouterr().out
    finally:
        proc.kill()


def test_more_gloo_processes_than_usable_cores_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("eyas.train.preflight.usable_cores", lambda: 2)
    report = device_preflight(TrainConfig(num_processes=64, backend="gloo"), tmp_path)
    assert report.devices[0]["cores"] == 2 and report.problems == [
        "train.num_processes=64 with train.backend='gloo' starts 64 trainer processes, but this process may use 2 CPU "
        "core(s); expected at most one process per core (more share the cores, and every step waits on the slowest); "
        "lower train.num_processes to 2 or fewer, or train on GPUs (train.backend='nccl')"
    ]
    assert device_preflight(TrainConfig(num_processes=2, backend="gloo"), tmp_path).ok
