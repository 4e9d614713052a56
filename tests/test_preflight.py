"""Device preflight and the registry of processes eyas starts."""

import json
import subprocess
import sys
import time

from eyas.config import TrainConfig
from eyas.train.preflight import (
    alive_recorded,
    device_preflight,
    parse_nvidia_smi,
    read_registry,
    record_launch,
    stop_recorded,
)

SMI = "0, 3, 81559\n1, 40211, 81559\n"


def test_cpu_preflight_reports_gloo_and_passes(tmp_path):
    report = device_preflight(TrainConfig(num_processes=2, backend="gloo"), tmp_path)
    assert report.ok and report.devices[0]["device"] == "cpu" and report.devices[0]["processes"] == 2


def test_busy_gpu_is_refused_with_its_memory(tmp_path):
    train = TrainConfig(num_processes=2, backend="nccl", max_idle_gpu_memory_mib=1024)
    report = device_preflight(train, tmp_path, gpus=parse_nvidia_smi(SMI))
    assert not report.ok
    assert report.problems == [
        "cuda:1: 40211 MiB of 81559 MiB already in use, expected at most train.max_idle_gpu_memory_mib=1024; "
        "another job holds this GPU: stop it or pick other devices"
    ]
    assert [d["busy"] for d in report.devices] == [False, True]


def test_too_few_gpus_is_refused(tmp_path):
    report = device_preflight(TrainConfig(num_processes=8, backend="nccl"), tmp_path, gpus=parse_nvidia_smi(SMI))
    assert report.problems[0] == (
        "train.num_processes=8 but 2 GPU(s) are visible; expose more GPUs (CUDA_VISIBLE_DEVICES) or lower train.num_processes"
    )


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
        assert capsys.readouterr().out.strip() == f"stopped [{proc.pid}]"
        assert proc.wait(timeout=15) != 0
        assert main(["stop", str(tmp_path)]) == 0
        assert "no process recorded" in capsys.readouterr().out
    finally:
        proc.kill()
