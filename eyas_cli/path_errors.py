"""An operating system's error on a path, told as a user error: the config field that names the path (when a
run's config is known), what was found there, what the field expects (its description in eyas.config) and the
fix.

    explain_os_error(IsADirectoryError(21, "Is a directory", "/data"), config)
    -> "dataset.prompts_path='/data': a directory, expected a file (conversations: JSONL or Parquet of ...);
        name the file itself in dataset.prompts_path"
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


def path_fields(config) -> dict[str, str]:
    """Every non-empty string field of a RunConfig, by dotted name (the paths among them)."""
    found: dict[str, str] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        elif isinstance(value, str) and value and "://" not in value:
            found[prefix] = value

    walk("", config.model_dump(mode="json"))
    return found


def owner(path: Path, config) -> tuple[str, str] | None:
    """(field, value) of the config field naming `path` itself, else the one naming the nearest directory above
    it (the workdir, for a stage's output)."""
    if config is None:
        return None
    path = path.absolute()
    exact, above = [], []
    for field, value in path_fields(config).items():
        named = Path(value).absolute()
        if named == path:
            exact.append((field, value))
        elif named in path.parents:
            above.append((len(named.parts), field, value))
    if exact:
        return exact[0]
    return max(above)[1:] if above else None


def field_description(config, field: str) -> str:
    """The field's description in the config tree (what it expects), or ''."""
    model, info = type(config), None
    for part in field.split("."):
        info = getattr(model, "model_fields", {}).get(part)
        if info is None:
            return ""
        model = info.annotation
    return (info.description or "") if info is not None else ""


def blocking_file(path: Path) -> Path | None:
    """The nearest existing path at or above `path` when it is not a directory (a file on the way)."""
    existing = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
    return existing if existing is not None and not existing.is_dir() else None


def explain_os_error(err: OSError, config=None) -> str:
    """Object, found, expected and fix for an OSError carrying a filename (see the module docstring)."""
    path = Path(os.fsdecode(err.filename))
    named = owner(path, config)
    if named is None:
        subject, expected, fix = str(path), "", "fix the path"
    else:
        field, value = named
        exact = Path(value).absolute() == path.absolute()
        subject = f"{field}={value!r}" + ("" if exact else f" (under it: {path})")
        expected = field_description(config, field) if exact else ""  # what the field names, not what is under it
        fix = f"fix {field} in the config"
    wanted = f" ({expected})" if expected else ""
    if isinstance(err, IsADirectoryError):
        return f"{subject}: a directory, expected a file{wanted}; name the file itself ({fix})"
    if isinstance(err, NotADirectoryError):
        blocker = blocking_file(path.absolute())
        on_way = f"{blocker} is a file" if blocker is not None else "a file where a directory belongs"
        return f"{subject}: {on_way}, expected a directory{wanted}; {fix}, or move the file away"
    if isinstance(err, FileNotFoundError):
        return f"{subject}: no such file or directory, expected{wanted or ' it to exist'}; {fix}"
    if isinstance(err, PermissionError):
        return (
            f"{subject}: permission denied, expected a path this user (uid {os.getuid()}) may read (and write, where "
            f"eyas writes){wanted}; fix its permissions or {fix}"
        )
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{subject}: {err.strerror}; free space on its file system (or raise the quota), or {fix}"
    if isinstance(err, FileExistsError):
        kind = "a directory" if path.is_dir() else "a file"
        return f"{subject}: {kind} is in the way of what eyas creates there{wanted}; move it away or {fix}"
    code = errno.errorcode.get(err.errno or 0, "")
    return f"{subject}: {err.strerror}{f' ({code})' if code else ''}{wanted}; {fix}"


def file_holding(data: bytes, places) -> Path | None:
    """The file whose bytes are `data` (what a JSONDecodeError or UnicodeDecodeError was decoding): a file among
    `places`, or a *.json in a directory among them."""
    for place in map(Path, places):
        candidates = sorted(place.glob("*.json")) if place.is_dir() else [place] if place.is_file() else []
        for path in candidates:
            if path.stat().st_size == len(data) and path.read_bytes() == data:
                return path
    return None


def _named_file(data: bytes, config, places) -> str | None:
    """The file holding `data`, with the config field that names it (or its directory), for a message."""
    fields = path_fields(config) if config is not None else {}
    path = file_holding(data, [*fields.values(), *places])
    if path is None:
        return None
    named = owner(path, config)
    return f"{path}" + (f" (named by {named[0]}={named[1]!r})" if named else "")


def explain_json_error(err, config=None, places=()) -> str:
    """A JSONDecodeError told as the file it is in (found among the config's paths and `places`), where, and the fix."""
    where = f"line {err.lineno} column {err.colno}"
    name = _named_file(err.doc.encode(), config, places)
    if name is None:
        return f"a JSON file is not valid JSON ({err.msg} at {where}); expected valid JSON: fix the file"
    return f"{name}: not valid JSON ({err.msg} at {where}); expected valid JSON: fix the file, or restore it"


def explain_unicode_error(err: UnicodeDecodeError, config=None, places=()) -> str:
    """A UnicodeDecodeError told as the file it is in (when found), the byte, and the fix."""
    found = f"{err.reason} at byte {err.start}: {err.object[err.start : err.start + 8]!r}"
    name = _named_file(bytes(err.object), config, places) if len(err.object) < 1 << 24 else None
    return (
        f"{name or 'a file'}: not UTF-8 text ({found}); expected UTF-8: re-encode the file (e.g. `iconv -f LATIN1 "
        "-t UTF-8`)"
    )


def explain_read_error(err: BaseException, places=()) -> str:
    """What a verb that reads files (inspect, remap) says for an error: the file and the fix where one is known."""
    if type(err).__name__ == "JSONDecodeError" and hasattr(err, "doc"):
        return explain_json_error(err, places=places)
    if isinstance(err, UnicodeDecodeError):
        return explain_unicode_error(err, places=places)
    if isinstance(err, OSError) and err.filename is not None and len(err.args) > 1:
        return explain_os_error(err)
    return str(err)
