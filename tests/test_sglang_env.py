"""SGLang's own environment beside eyas's: the capture module installs there alone, and every server runs there.

A second environment is built offline the way a GPU machine's SGLang environment stands to eyas's: a venv of
the base interpreter (no site packages) whose only packages are torch and safetensors and what they require
themselves (their distributions linked from this environment through one .pth; no transformers, numpy,
pydantic or anything else of eyas's). The eyas-capture wheel (eyas.engines.capture_wheel) is installed into
it by pip from the wheel alone (--no-index), and the capture module is imported there.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from shlex import quote as q

import pytest
from packaging.requirements import Requirement

from eyas.config import ExtractConfig, SGLangEnvConfig, SGLangExtractConfig
from eyas.engines.capture_wheel import write_capture_wheel
from eyas.engines.sglang import SglangLaunch, SglangServer, SglangServerError, SGLangVersionError
from eyas.engines.sglang_env import check_capture_module, check_engine_environment, probe
from eyas.extract.backends import open_backend
from eyas.extract.backends.sglang import CAPTURE_MODULE, SGLangBackend

REPO = Path(__file__).resolve().parents[1]
CAPTURE_NEEDS = ("torch", "safetensors")
EYAS_ONLY = ("transformers", "numpy", "pydantic", "prefect", "httpx", "pyarrow")  # eyas's, not the module's


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def required_distributions(names) -> set[str]:
    """The distributions `names` need, transitively, as their metadata says (no extras)."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        for line in importlib.metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def link_distributions(names: set[str], out: Path) -> None:
    """Each distribution's top-level files and its dist-info, linked into `out` (one folder for a .pth)."""
    out.mkdir()
    for name in names:
        dist = importlib.metadata.distribution(name)
        base = Path(dist.locate_file(""))
        tops = {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}
        for top in sorted(t for t in tops if not t.endswith(".pth")):
            if (base / top).exists() and not (out / top).exists():
                (out / top).symlink_to(base / top)


@pytest.fixture(scope="module")
def sglang_env(tmp_path_factory) -> Path:
    """The interpreter of a venv holding torch and safetensors (and their requirements) only, and eyas-capture."""
    root = tmp_path_factory.mktemp("sglang-env")
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    link_distributions(required_distributions(CAPTURE_NEEDS), root / "deps")
    [site] = (root / "venv" / "lib").glob("python*/site-packages")
    (site / "torch-and-safetensors.pth").write_text(f"{root / 'deps'}\n")
    python = root / "venv" / "bin" / "python"
    with pytest.MonkeyPatch.context() as mp:  # nothing of eyas's sources on the path: cwd and PYTHONPATH
        mp.chdir(root)
        mp.delenv("PYTHONPATH", raising=False)
        assert probe(str(python), "sglang.launch_server", [CAPTURE_MODULE])["found"][CAPTURE_MODULE] is None
    wheel = write_capture_wheel(root / "wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--isolated", "--python", str(python), "install", "--no-index",
         "--disable-pip-version-check", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    # pip found every requirement of the wheel already there and installed the wheel alone
    assert "Installing collected packages: eyas-capture\n" in done.stdout
    return python


def test_the_capture_module_installs_and_imports_where_only_torch_and_safetensors_are(sglang_env):
    script = (
        "import importlib.util, importlib.metadata, sys\n"
        "import eyas.extract.capture_hook as hook\n"
        "print(hook.__file__)\n"
        "print(callable(hook.make_hook), importlib.metadata.version('eyas-capture'))\n"
        f"print([n for n in {EYAS_ONLY!r} if importlib.util.find_spec(n) is not None])\n"
    )
    done = subprocess.run([str(sglang_env), "-W", "ignore", "-c", script], capture_output=True, text=True,
                          cwd=sglang_env.parents[2], env={"PATH": os.environ["PATH"]})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    where, made, absent = done.stdout.splitlines()
    assert where.startswith(str(sglang_env.parents[1] / "lib")) and where.endswith("eyas/extract/capture_hook.py")
    assert made == "True 0.1.0" and absent == "[]"


def test_eyas_finds_its_own_capture_module_there_and_refuses_a_changed_one(sglang_env, monkeypatch):
    monkeypatch.chdir(sglang_env.parents[2])  # neither the working directory nor PYTHONPATH holds eyas's sources
    monkeypatch.delenv("PYTHONPATH", raising=False)
    found = probe(str(sglang_env), "sglang.launch_server", [CAPTURE_MODULE, *CAPTURE_NEEDS])["found"]
    assert check_capture_module(found, CAPTURE_MODULE, str(sglang_env)) == []
    installed = Path(found[CAPTURE_MODULE])
    assert installed.is_relative_to(sglang_env.parents[1] / "lib")  # the wheel's copy, never eyas's own file
    original = installed.read_text()
    try:
        installed.write_text(original + "# an older eyas\n")
        [problem] = check_capture_module(found, CAPTURE_MODULE, str(sglang_env))
    finally:
        installed.write_text(original)
    assert f"{CAPTURE_MODULE} there ({installed}) differs from eyas's" in problem
    assert (
        f"reinstall it there: python -m eyas.engines.capture_wheel --out /tmp/eyas-capture, then {sglang_env} -m pip"
        in problem
    )


def test_an_environment_without_sglang_is_refused_before_a_launch(sglang_env, monkeypatch):
    monkeypatch.chdir(sglang_env.parents[2])
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with pytest.raises(SglangServerError) as err:
        check_engine_environment(str(sglang_env), "sglang.launch_server", capture_module=CAPTURE_MODULE)
    assert str(err.value) == (
        f"sglang.python={sglang_env} cannot start this server:\n  no module 'sglang' there (it runs `-m "
        "sglang.launch_server`); install SGLang 0.5.23 in that environment, or point sglang.python at the one that "
        "has it"
    )


def test_an_interpreter_that_is_not_there_is_refused_before_a_launch(tmp_path):
    launch = SglangLaunch(str(tmp_path), None, python=str(tmp_path / "no-python"))
    with pytest.raises(SglangServerError, match=r"sglang.python=.*/no-python: cannot run it \(FileNotFoundError"):
        SglangServer(launch, tmp_path / "log", 10).__enter__()
    assert not (tmp_path / "log").exists()  # nothing was launched


def fake_sglang(root: Path, version: str) -> Path:
    """A folder with a distribution named sglang at `version` (what `pip install sglang` leaves, minus the code)."""
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    (root / f"sglang-{version}.dist-info").mkdir()
    (root / f"sglang-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n"
    )
    return root


def test_an_unchecked_sglang_release_is_refused_before_its_model_loads_unless_allowed(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(fake_sglang(tmp_path / "site", "0.5.24")))
    with pytest.raises(SGLangVersionError) as err:
        check_engine_environment(sys.executable, "sglang.launch_server")
    message = str(err.value)
    assert message.startswith(f"sglang.python={sys.executable} ({sys.executable}): SGLang 0.5.24 is not a release "
                              "eyas has checked (0.5.23); not checked on 0.5.24: the layer each aux id captures")  # fmt: skip
    assert 'or add "0.5.24" to sglang.allow_unchecked_versions to run with it unchecked' in message
    env = check_engine_environment(sys.executable, "sglang.launch_server", allowed_versions=["0.5.24"])
    assert env.sglang_version == "0.5.24"


def test_extraction_launches_sglang_with_the_configured_interpreter_not_eyas_own(tmp_path, random_target_dir):
    """The configured interpreter records each call and runs this one: eyas asks it about its environment, then
    launches the server with it (here `-m http.server`, which refuses SGLang's flags and exits at once)."""
    record = tmp_path / "calls"
    python = tmp_path / "sglang-env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        f'#!/bin/sh\necho "$0 $*" | tr "\\n" " " >> {q(str(record))}\necho >> {q(str(record))}\nexec {q(sys.executable)} "$@"\n'
    )
    python.chmod(0o755)
    cfg = SGLangExtractConfig(port=free_port(), startup_timeout_s=30, capture_dir=str(tmp_path / "capture"))
    with pytest.raises(SglangServerError, match=r"exited with code 2 before GET /health answered 200"):
        SGLangBackend(cfg, target_path=str(random_target_dir), aux_layer_ids=[2, 4, 5], hidden_size=64,
                      launch_module="http.server", log_path=tmp_path / "server.log",
                      env=SGLangEnvConfig(python=str(python)))  # fmt: skip
    probe_call, launch_call = record.read_text().splitlines()
    assert probe_call.startswith(f"{python} -c ") and probe_call.endswith(
        f"http.server {CAPTURE_MODULE} torch safetensors "
    )
    assert launch_call.startswith(f"{python} -m http.server --model-path {random_target_dir} --host 127.0.0.1 ")
    assert "--forward-hooks" in launch_call and sys.executable not in launch_call


def test_the_extraction_entry_launches_in_the_runs_sglang_environment_with_trust_remote_code(
    tmp_path, random_target_dir, monkeypatch
):
    """open_backend (what every extraction worker calls, with the run's facts): the server's command is the
    configured interpreter's, with --trust-remote-code. That interpreter answers eyas's question with an SGLang
    0.5.23 distribution on its path, records the server's command and exits."""
    site = fake_sglang(tmp_path / "site", "0.5.23")
    record = tmp_path / "launches"
    python = tmp_path / "sglang-env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        f'#!/bin/sh\nif [ "$1" = "-m" ]; then echo "$0 $*" >> {q(str(record))}; exit 3; fi\n'
        f'PYTHONPATH={q(f"{site}:{REPO}")} exec {q(sys.executable)} "$@"\n'
    )
    python.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    port = free_port()
    cfg = ExtractConfig(backend="sglang", sglang=SGLangExtractConfig(port=port, startup_timeout_s=30,
                                                                     capture_dir=str(tmp_path / "capture")))  # fmt: skip
    with pytest.raises(SglangServerError, match=r"exited with code 3 before GET /health answered 200"):
        open_backend(cfg, target_path=str(random_target_dir), target_dtype="float32", aux_layer_ids=[2, 4, 5],
                     hidden_size=64, device="cpu", trust_remote_code=True,
                     sglang_env=SGLangEnvConfig(python=str(python)))  # fmt: skip
    [launch] = record.read_text().splitlines()
    assert launch.startswith(
        f"{python} -m sglang.launch_server --model-path {random_target_dir} --host 127.0.0.1 --port {port} "
        "--trust-remote-code --tp-size 1 "
    )
