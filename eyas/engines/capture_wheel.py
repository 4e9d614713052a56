"""The `eyas-capture` wheel: eyas's capture module alone, for SGLang's environment.

    python -m eyas.engines.capture_wheel --out /tmp/eyas-capture      # prints the wheel's path
    /opt/sglang/bin/python -m pip install --no-deps /tmp/eyas-capture/eyas_capture-0.1.0-py3-none-any.whl

SGLang loads eyas.extract.capture_hook through --forward-hooks, so its interpreter must import it; eyas itself
pins another torch and transformers than SGLang does. The wheel holds eyas/__init__.py,
eyas/extract/__init__.py (both import nothing) and eyas/extract/capture_hook.py, and requires torch and
safetensors only, unpinned: installing it changes nothing else in SGLang's environment. Written here with the
standard library (a wheel is a zip with METADATA, WHEEL and RECORD), with fixed timestamps, so the same sources
give the same bytes and no build backend or index is needed.
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import sys
import zipfile
from pathlib import Path

import eyas

NAME = "eyas-capture"
FILES = ("eyas/__init__.py", "eyas/extract/__init__.py", "eyas/extract/capture_hook.py")
REQUIRES = ("torch", "safetensors")
HOST = "sglang"  # the server the module runs in (imported there inside a function, never at import time)
ROOT = Path(eyas.__file__).resolve().parents[1]
ZIP_TIME = (1980, 1, 1, 0, 0, 0)


def imported_outside(path: Path) -> list[str]:
    """Top-level modules `path` imports that are neither the standard library, REQUIRES nor the host server."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    allowed = {*REQUIRES, HOST, "__future__"}
    return sorted(n for n in names if n not in sys.stdlib_module_names and n not in allowed)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write_capture_wheel(out_dir: str | Path) -> Path:
    """Write the wheel into `out_dir`; its path. Refuses a capture module that imports more than it may."""
    extra = {f: imported_outside(ROOT / f) for f in FILES}
    extra = {f: names for f, names in extra.items() if names}
    if extra:
        raise ValueError(
            f"{NAME}: {extra} import modules beyond the standard library and {', '.join(REQUIRES)}; expected none: "
            "SGLang's environment has its own pins, and this wheel brings nothing else"
        )
    dist_info = f"{NAME.replace('-', '_')}-{eyas.__version__}.dist-info"
    metadata = "\n".join(
        ["Metadata-Version: 2.1", f"Name: {NAME}", f"Version: {eyas.__version__}",
         "Summary: eyas's capture module (eyas.extract.capture_hook) for an SGLang server's --forward-hooks",
         *(f"Requires-Dist: {r}" for r in REQUIRES), ""]
    )  # fmt: skip
    wheel = "Wheel-Version: 1.0\nGenerator: eyas.engines.capture_wheel\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    entries = [(f, (ROOT / f).read_bytes()) for f in FILES]
    entries += [(f"{dist_info}/METADATA", metadata.encode()), (f"{dist_info}/WHEEL", wheel.encode())]
    record = "\n".join([_record_line(n, d) for n, d in entries] + [f"{dist_info}/RECORD,,", ""])
    entries.append((f"{dist_info}/RECORD", record.encode()))
    out = Path(out_dir) / f"{NAME.replace('-', '_')}-{eyas.__version__}-py3-none-any.whl"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".whl.tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries:
            info = zipfile.ZipInfo(name, date_time=ZIP_TIME)
            info.external_attr = 0o644 << 16  # rw-r--r-- once unpacked
            zf.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m eyas.engines.capture_wheel", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder to write the wheel into")
    print(write_capture_wheel(ap.parse_args().out))


if __name__ == "__main__":
    main()
