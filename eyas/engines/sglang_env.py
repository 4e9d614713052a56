"""SGLang's own environment, checked from eyas's before a server loads its model.

    env = check_engine_environment("/opt/sglang/bin/python", "sglang.launch_server",
                                   allowed_versions=(), capture_module="eyas.extract.capture_hook")
    env.sglang_version       # "0.5.23", as that environment's package metadata says (None: not installed)

SGLang 0.5.23 pins torch 2.14.1 and transformers 5.19.0, eyas torch 2.13.0 and transformers 5.24.0, so each
lives in its own environment on one machine: eyas launches every server with `sglang.python`, and only eyas's
capture module (torch and safetensors, nothing else of eyas) is installed there, as the distribution
`eyas-capture` (eyas.engines.capture_wheel). A few milliseconds of that interpreter, before a model load of up
to an hour, find what would otherwise fail after it: an interpreter that is not there, no SGLang, an unchecked
SGLang release, no capture module, or a capture module older than eyas's (the server would write files this
eyas does not read).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from eyas.engines.sglang_release import SglangServerError, check_sglang_version

# Run by the engine's interpreter: what it has, without importing SGLang (seconds) or torch.
PROBE = """
import importlib.metadata, importlib.util, json, sys
def origin(name):
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return None if spec is None else (spec.origin or "(namespace package)")
try:
    version = importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    version = None
names = [sys.argv[1].split(".")[0]] + sys.argv[2:]
print(json.dumps({"executable": sys.executable, "sglang": version, "found": {n: origin(n) for n in names}}))
"""
CAPTURE_NEEDS = ("torch", "safetensors")
INSTALL_CAPTURE = (
    "install it there: python -m eyas.engines.capture_wheel --out /tmp/eyas-capture, then SGLANG_PYTHON -m pip "
    "install /tmp/eyas-capture/eyas_capture-*.whl (it needs only torch and safetensors, which SGLang has; "
    "README: A GPU machine)"
)


@dataclass(frozen=True)
class EngineEnvironment:
    python: str
    executable: str
    sglang_version: str | None


def probe(python: str, module: str, extra_modules: Sequence[str] = ()) -> dict:
    """What `python` finds: its executable, SGLang's installed version, where each module comes from."""
    what = f"sglang.python={python}"
    try:
        done = subprocess.run([python, "-c", PROBE, module, *extra_modules], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
    except (FileNotFoundError, PermissionError) as err:
        raise SglangServerError(
            f"{what}: cannot run it ({type(err).__name__}: {err}); expected the interpreter of SGLang's environment "
            "(e.g. /opt/sglang/bin/python; README: A GPU machine), or empty for the interpreter running eyas"
        ) from err
    if done.returncode != 0:
        raise SglangServerError(f"{what}: exited with code {done.returncode}: {done.stderr.strip()[-1000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_capture_module(found: dict, capture_module: str, python: str) -> list[str]:
    """Problems of eyas's capture module as `python` sees it: missing, its needs missing, or not eyas's own."""
    problems = [f"{n} is not installed there, the capture module imports it" for n in CAPTURE_NEEDS if not found[n]]
    origin = found[capture_module]
    if not origin:
        return problems + [f"{capture_module} is not importable there (SGLang's --forward-hooks loads it); "
                           + INSTALL_CAPTURE.replace("SGLANG_PYTHON", python)]  # fmt: skip
    import importlib.util

    own = importlib.util.find_spec(capture_module).origin
    if _file_digest(origin) != _file_digest(own):
        problems.append(
            f"{capture_module} there ({origin}) differs from eyas's ({own}): the server would write files this eyas "
            "does not read; " + INSTALL_CAPTURE.replace("SGLANG_PYTHON", python).replace("install it", "reinstall it")
        )
    return problems


def check_engine_environment(
    python: str, module: str, *, allowed_versions: Sequence[str] = (), capture_module: str = ""
) -> EngineEnvironment:
    """Refuse, before any model loads, an interpreter that cannot serve: see the module docstring."""
    found = probe(python, module, [capture_module, *CAPTURE_NEEDS] if capture_module else [])
    where = f"sglang.python={python}"
    top = module.split(".")[0]
    problems = [] if found["found"][top] else [f"no module {top!r} there (it runs `-m {module}`); install SGLang "
                                               "0.5.23 in that environment, or point sglang.python at the one "
                                               "that has it"]  # fmt: skip
    if capture_module:
        problems += check_capture_module(found["found"], capture_module, python)
    if problems:
        raise SglangServerError(f"{where} cannot start this server:\n  " + "\n  ".join(problems))
    if found["sglang"] is not None:
        check_sglang_version(found["sglang"], allowed_versions, f"{where} ({found['executable']})")
    return EngineEnvironment(python, found["executable"], found["sglang"])
