"""What the `eyas` command prints when something goes wrong: one short message on stderr, never a traceback
for a mistake a user can make.

    sys.exit(guarded(lambda: dispatch(args), debug=args.debug))

- bad input (a config that does not validate, a missing or foreign file, a bad id, a run in the wrong state,
  an unreachable server, a refused engine command): the message, and exit code 2;
- a failed run: the verb itself returns 1;
- anything else is a bug: the traceback, a line saying so and how to report it, exit code 3.
`--debug` (or EYAS_DEBUG=1) prints the traceback for every error.
A config that does not validate is listed field by field in eyas's own words: the path of each invalid
field, the value found and what is expected, and the preset to copy from.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

EXIT_BAD_INPUT = 2
EXIT_BUG = 3
PRESET_HINT = "deployments/tiny-cpu.json (README 'Presets and work pools' lists the others)"


class UserError(Exception):
    """A mistake the message explains; `eyas_cli` raises it for what the library has no error of its own for."""


def _expected(err: dict) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    words = {
        "missing": "a value (the field is required)",
        "int_parsing": "an integer",
        "int_type": "an integer",
        "int_from_float": "an integer",
        "float_parsing": "a number",
        "float_type": "a number",
        "bool_parsing": "true or false",
        "bool_type": "true or false",
        "string_type": "a string",
        "list_type": "a list",
        "dict_type": "an object",
        "model_type": "an object",
        "model_attributes_type": "an object",
    }
    if kind in words:
        return words[kind]
    if kind == "literal_error":
        return f"one of {ctx.get('expected')}"
    for bound, text in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if bound in ctx:
            return f"a value {text} {ctx[bound]}"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"])).removeprefix("Value error, ")
    return err["msg"]


def format_validation_error(err, source: str, model=None) -> str:
    """Every invalid field of a pydantic ValidationError, one line each, in eyas's words."""
    lines = [f"{source}: {err.error_count()} problem(s); fix them, or start from {PRESET_HINT}"]
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(the whole config)"
        if e["type"] == "json_invalid":
            lines.append(f"  not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}")
        elif e["type"] == "extra_forbidden":
            known = _fields_at(model, e["loc"][:-1])
            lines.append(f"  {where}: unknown field" + (f"; expected one of {known}" if known else ""))
        elif e["type"] == "missing":
            lines.append(f"  {where}: missing; expected {_expected(e)}")
        else:
            lines.append(f"  {where}: found {e.get('input')!r}, expected {_expected(e)}")
    return "\n".join(lines)


def _fields_at(model, loc: tuple) -> list[str]:
    """The field names of the (nested) model at `loc`, for an unknown-field message."""
    from pydantic import BaseModel

    current = model
    for part in loc:
        field = getattr(current, "model_fields", {}).get(part) if current is not None else None
        annotation = getattr(field, "annotation", None)
        current = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return sorted(current.model_fields) if current is not None else []


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exceptions that mean bad input or an unreachable service, not a bug."""
    import httpx
    from prefect.exceptions import ObjectNotFound
    from safetensors import SafetensorError

    from eyas.engines.sglang import SglangServerError

    return (UserError, ValueError, OSError, KeyError, SafetensorError, httpx.HTTPError, SglangServerError,
            ObjectNotFound)  # fmt: skip


def guarded(fn: Callable[[], int], *, debug: bool = False) -> int:
    """fn's exit code; an error becomes one message (see the module docstring)."""
    debug = debug or os.environ.get("EYAS_DEBUG") == "1"
    try:
        return fn()
    except KeyboardInterrupt:
        print("eyas: interrupted", file=sys.stderr)
        return 130
    except user_error_types() as err:
        if debug:
            traceback.print_exc()
        print(f"eyas: {describe(err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception:  # noqa: BLE001 -- a bug: shown whole, with how to report it
        traceback.print_exc()
        print(
            "eyas: internal error (a bug in eyas, not in your input): please report it with the command, the "
            "traceback above and `eyas status --json`",
            file=sys.stderr,
        )
        return EXIT_BUG


def describe(err: BaseException) -> str:
    from pydantic import ValidationError

    if isinstance(err, ValidationError):
        return format_validation_error(err, err.title)
    if isinstance(err, FileNotFoundError) and err.filename and not err.args[1:] == ():
        return f"{err.filename}: no such file or directory"
    if isinstance(err, KeyError):
        return str(err.args[0]) if err.args else "missing key"
    text = str(err) or type(err).__name__
    mine = isinstance(err, (UserError, ValueError)) or type(err).__module__.startswith("eyas")
    return text if mine else f"{type(err).__name__}: {text}"
