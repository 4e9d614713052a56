"""What the `eyas` command prints when something goes wrong: one short message on stderr, never a traceback
for a mistake a user can make.

    sys.exit(guarded(lambda: dispatch(args), debug=args.debug))

- bad input (a config that does not validate, a missing or foreign file, a bad id, a run in the wrong state,
  an unreachable server, a refused engine command): the message, and exit code 2;
- a failed run: the verb itself returns 1;
- anything else is a bug: the traceback, a line saying so and how to report it, exit code 3.
A user error raised inside a flow (a stage refusing its input) ends the same way: the flow's failed state carries
it back (`raise_user_error`), and the console shows Prefect's log lines about it without the traceback
(`quiet_user_error_tracebacks`; the server's logs keep it). An operating system's error on a path (a directory
where a file belongs, a file on the way to the workdir, a missing or unreadable file) is told as the config
field that names the path, what was found, what the field expects and the fix (`describe(err, config)`).
`--debug` (or EYAS_DEBUG=1) prints the traceback for every error.
A config that does not validate is listed field by field in eyas's own words: the path of each invalid
field, the value found and what is expected, and the preset to copy from.
"""

from __future__ import annotations

import contextlib
import logging
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
    if kind == "string_pattern_mismatch":
        return f"a string matching {ctx.get('pattern')}"
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
        elif e["type"] == "value_error" and isinstance(e.get("input"), dict):  # a section's check: its own words
            lines.append(f"  {_expected(e)}")
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


# Error classes of libraries, by module: only those already imported can have been raised, so an error is
# classified without importing a library for it (prefect alone costs a second).
_LIBRARY_USER_ERRORS = (("safetensors", "SafetensorError"), ("httpx", "HTTPError"),
                        ("eyas.engines.sglang_release", "SglangServerError"), ("prefect.exceptions", "ObjectNotFound"))  # fmt: skip


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exceptions that mean bad input or an unreachable service, not a bug."""
    loaded = (sys.modules.get(module) for module, _ in _LIBRARY_USER_ERRORS)
    extra = (getattr(m, name, None) for m, (_, name) in zip(loaded, _LIBRARY_USER_ERRORS) if m is not None)
    return (UserError, ValueError, OSError, KeyError, *(cls for cls in extra if isinstance(cls, type)))


_DEBUG = {"on": False}  # --debug, as guarded was given it


def debugging() -> bool:
    return _DEBUG["on"] or os.environ.get("EYAS_DEBUG") == "1"


def guarded(fn: Callable[[], int], *, debug: bool = False) -> int:
    """fn's exit code; an error becomes one message (see the module docstring)."""
    _DEBUG["on"] = debug  # also read by quiet_user_error_tracebacks
    debug = debugging()
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


def describe(err: BaseException, config=None) -> str:
    """The message of a user error; `config` (a RunConfig) names the field behind a path an OSError names."""
    from pydantic import ValidationError

    if isinstance(err, ValidationError):
        return format_validation_error(err, err.title)
    if isinstance(err, OSError) and err.filename is not None and len(err.args) > 1:
        from eyas_cli.path_errors import explain_os_error

        return explain_os_error(err, config)
    if type(err).__name__ == "JSONDecodeError" and hasattr(err, "doc"):
        from eyas_cli.path_errors import explain_json_error

        return explain_json_error(err, config)
    if isinstance(err, UnicodeDecodeError):
        from eyas_cli.path_errors import explain_unicode_error

        return explain_unicode_error(err, config)
    if isinstance(err, KeyError):
        return str(err.args[0]) if err.args else "missing key"
    text = str(err) or type(err).__name__
    worded = isinstance(err, OSError) and len(err.args) == 1 and isinstance(err.args[0], str)  # eyas's own words
    mine = worded or isinstance(err, (UserError, ValueError)) or type(err).__module__.startswith("eyas")
    return text if mine else f"{type(err).__name__}: {text}"


@contextlib.contextmanager
def user_errors_of(config):
    """Inside: a user error becomes a UserError worded with the run's config (its path fields named)."""
    try:
        yield
    except UserError:
        raise
    except user_error_types() as err:
        raise UserError(describe(err, config)) from err


def raise_user_error(state) -> None:
    """When a flow's state failed on a user error (a stage refused its input), raise that error: the command
    then ends with its message and exit code 2, as when the CLI finds it. A failed run is left to the caller."""
    if not state.is_failed():
        return  # completed, or crashed or cancelled: not the input's fault
    err = state.result(raise_on_failure=False)
    if isinstance(err, user_error_types()):
        raise err


class _UserErrorsInOneLine(logging.Formatter):
    """A console formatter around another: a record about a user error is shown without its traceback."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        err = record.exc_info[1] if record.exc_info else None
        if err is None or not isinstance(err, user_error_types()):
            return self.inner.format(record)
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text = saved


def quiet_user_error_tracebacks() -> None:
    """Prefect's console log lines about a user error lose their traceback (unless --debug); the handlers that
    send logs to the server keep theirs. Call once Prefect has set up its logging (after importing prefect)."""
    if debugging():
        return
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler.formatter, _UserErrorsInOneLine):
            handler.setFormatter(_UserErrorsInOneLine(handler.formatter or logging.Formatter()))
