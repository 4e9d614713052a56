"""Third-party kits: pinned wheels of the tools eyas's conformance tests run, installed beside the environment.

    python scripts/kits.py install                     # every kit in kits/ (those already installed are kept)
    python scripts/kits.py install speculators-0.9.0
    python scripts/kits.py run speculators-0.9.0 -- python scripts/build_speculators_fixtures.py ...

A kit is `kits/NAME.txt`: pip requirements, each with its sha256. It is installed with
`pip install --no-deps --require-hashes --only-binary :all: --target .kits/NAME`: nothing in the environment
is replaced (torch stays the pinned CPU build), a wheel whose hash differs is refused, and pip's cache keeps
the downloads. A kit named `*-wheels` is only downloaded (`pip download`, same checks) into `.kits/NAME`:
its wheels are read as archives (an engine's source), never imported. A process that puts `.kits/NAME` first on its path (`kit_env`) imports the kit's packages
and takes everything else from the environment. `.kits/NAME/KIT_STAMP` holds the sha256 of the lock file
it was installed from: a changed lock file is installed again, and `require_kit` refuses a kit that is
missing or stale, with the command that fixes it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "kits"
KITS = REPO / ".kits"
STAMP = "KIT_STAMP"


def kit_names() -> list[str]:
    return sorted(p.stem for p in LOCKS.glob("*.txt"))


def lock_file(name: str) -> Path:
    path = LOCKS / f"{name}.txt"
    if not path.is_file():
        raise SystemExit(f"kit {name!r}: no {path}; expected one of {kit_names()}")
    return path


def kit_dir(name: str) -> Path:
    return KITS / name


def lock_digest(name: str) -> str:
    return hashlib.sha256(lock_file(name).read_bytes()).hexdigest()


def is_installed(name: str) -> bool:
    stamp = kit_dir(name) / STAMP
    return stamp.is_file() and stamp.read_text().strip() == lock_digest(name)


def install(name: str) -> Path:
    """Install kit `name` into .kits/NAME (a temporary beside it, renamed when complete); returns the folder."""
    final = kit_dir(name)
    if is_installed(name):
        return final
    temp = final.with_name(f".{name}.partial")
    shutil.rmtree(temp, ignore_errors=True)
    print(f"kit {name}: installing into {final}", flush=True)
    if name.endswith("-wheels"):  # pip resolves one version of a package per call: one call per wheel
        temp.mkdir(parents=True)
        for line in _requirements(name):
            single = temp / ".requirement.txt"
            single.write_text(line + "\n")
            subprocess.run(_pip("download", "-d", temp, single), check=True)
        (temp / ".requirement.txt").unlink()
    else:
        subprocess.run(_pip("install", "--target", temp, lock_file(name)), check=True)
    (temp / STAMP).write_text(lock_digest(name) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    temp.rename(final)
    return final


def _requirements(name: str) -> list[str]:
    lines = (line.strip() for line in lock_file(name).read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _pip(verb: str, where: str, folder: Path, requirements: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pip", verb, "--quiet", "--disable-pip-version-check", "--no-deps"]
    return cmd + ["--require-hashes", "--only-binary", ":all:", where, str(folder), "-r", str(requirements)]


def require_kit(name: str) -> Path:
    """The folder of an installed, current kit; otherwise an error naming the command that installs it."""
    if not is_installed(name):
        state = "stale (kits/{0}.txt changed since)".format(name) if kit_dir(name).is_dir() else "not installed"
        raise RuntimeError(
            f"kit {name}: {state}; expected {kit_dir(name)} installed from kits/{name}.txt: "
            f"run `make install` (or `python scripts/kits.py install {name}`)"
        )
    return kit_dir(name)


def kit_env(name: str, env: dict | None = None) -> dict:
    """An environment whose Python finds the kit's packages before the environment's own."""
    env = dict(os.environ if env is None else env)
    parts = [str(require_kit(name))] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="scripts/kits.py", description="install or use a third-party kit")
    sub = ap.add_subparsers(dest="verb", required=True)
    inst = sub.add_parser("install", help="install kits (default: every kit in kits/)")
    inst.add_argument("names", nargs="*")
    run = sub.add_parser("run", help="run a command with the kit first on PYTHONPATH")
    run.add_argument("name")
    run.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.verb == "install":
        for name in args.names or kit_names():
            install(name)
        return
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("scripts/kits.py run NAME -- COMMAND: expected a command after the kit's name")
    raise SystemExit(subprocess.run(command, env=kit_env(args.name)).returncode)


if __name__ == "__main__":
    main()
