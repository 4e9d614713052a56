"""Prepare what bench/gpu_truth.py needs on a GPU machine that has torch but not the whole project, and print the
command that runs it there.

Usage:
    .venv/bin/python scripts/gpu_wheels.py                # download the wheels (cached), print the device command
    .venv/bin/python scripts/gpu_wheels.py --print-only   # the command alone, nothing downloaded

Such a machine (Python 3.12, torch with CUDA, numpy, safetensors, pyarrow, xxhash, tensorboard, pytest,
transformers; no network) lacks the pure-Python or compiled packages below, which eyas.train.trainer, the
gpu-marked tests and bench/gpu_truth.py import (tests/test_gpu_truth.py checks that the import closure needs
nothing else). Their wheels for CPython 3.12 on manylinux x86-64, at the versions this project's environment runs
(pyproject.toml pins none of them exactly), go into the git-ignored folder .gpu-wheels/ (a few MB); a wheel
already there is not fetched again. The command carries that folder, installs the wheels with pip into
/tmp/site (no index, no dependencies) and runs bench/gpu_truth.py, which writes under $OUT.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEEL_DIR = ".gpu-wheels"
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64")
# name -> version: the project environment's (tests/test_gpu_truth.py holds them to it)
WHEELS = {
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "typing-extensions": "4.16.0",  # the image's may be older than pydantic needs
}
# what such a machine already holds, of what the closure imports (distribution names)
ON_THE_MACHINE = ("torch", "numpy", "safetensors", "pyarrow", "xxhash", "tensorboard", "pytest", "transformers",
                  "tokenizers", "httpx", "idna", "rich", "click", "tqdm", "cloudpickle", "pygments", "iniconfig",
                  "pluggy", "packaging", "pyyaml", "filelock", "huggingface-hub", "fsspec", "jinja2", "markupsafe",
                  "sympy", "mpmath", "networkx", "regex", "requests", "anyio", "certifi", "h11", "httpcore",
                  "markdown-it-py", "mdurl", "pytest-timeout", "hf-xet", "charset-normalizer", "urllib3", "sniffio",
                  "triton", "shellingham", "typer", "annotated-doc", "protobuf", "grpcio", "absl-py", "werkzeug",
                  "markdown", "six", "tensorboard-data-server", "setuptools", "pillow")  # fmt: skip


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_of(folder: Path, name: str) -> list[Path]:
    """The wheels of `name` (any version) in folder."""
    return [p for p in folder.glob("*.whl") if normalized(p.name.split("-")[0]) == normalized(name)]


def download(folder: Path, *, log=print) -> list[Path]:
    """Every wheel of WHEELS in folder: fetched when missing; a wheel of another version is removed first (two
    versions of one package stop pip's install)."""
    folder.mkdir(parents=True, exist_ok=True)
    wanted = []
    for name, version in WHEELS.items():
        present = wheel_of(folder, name)
        stale = [p for p in present if p.name.split("-")[1] != version]
        for path in stale:
            log(f"removing {path.name}: the project runs {name} {version}")
            path.unlink()
        if len(present) == len(stale):
            wanted.append(f"{name}=={version}")
    if wanted:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", PYTHON_VERSION, "--implementation", "cp",
               *[arg for platform in PLATFORMS for arg in ("--platform", platform)], "-d", str(folder), *wanted]  # fmt: skip
        log(f"downloading {', '.join(wanted)} for CPython {PYTHON_VERSION} (manylinux x86-64) into {folder}")
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(
                f"pip download of {wanted} failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}\n"
                "the wheels come from the package index: check the network, or place them in the folder by hand"
            )
    else:
        log(f"all {len(WHEELS)} wheels already in {folder}")
    return sorted(p for name in WHEELS for p in wheel_of(folder, name))


def device_command(wheel_dir: str = WHEEL_DIR, *, out: str = '"$OUT"', args: str = "") -> str:
    """The command to run on the device, from the repository root; `wheel_dir` relative to it."""
    folder = shlex.quote(wheel_dir)
    return (
        f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site {folder}/*.whl"
        " && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1"
        f" && python3 bench/gpu_truth.py --out {out}{' ' + args if args else ''}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/gpu_wheels.py", description=__doc__.splitlines()[0])
    ap.add_argument("--print-only", action="store_true", help="print the device command, download nothing")
    ap.add_argument(
        "--dir", default=WHEEL_DIR, help=f"the wheel folder, relative to the repository (default {WHEEL_DIR})"
    )
    args = ap.parse_args(argv)
    if Path(args.dir).is_absolute() or ".." in Path(args.dir).parts:
        raise SystemExit(f"--dir {args.dir}: expected a folder inside the repository, relative to it (it travels)")
    if not args.print_only:
        wheels = download(REPO / args.dir)
        size = sum(p.stat().st_size for p in wheels)
        print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB: " + ", ".join(p.name for p in wheels))
    print(f"carry: {[args.dir]}")
    print(f"command: {device_command(args.dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
