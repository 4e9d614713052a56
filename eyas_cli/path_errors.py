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


def json_file_with(doc: str, places) -> Path | None:
    """The JSON file whose text is `doc` (a JSONDecodeError's document): a file among `places`, or a *.json in a
    directory among them."""
    for place in map(Path, places):
        candidates = sorted(place.glob("*.json")) if place.is_dir() else [place] if place.is_file() else []
        for path in candidates:
            if path.stat().st_size == len(doc.encode()) and path.read_text(errors="replace") == doc:
                return path
    return None


def explain_json_error(err, config=None, places=()) -> str:
    """A JSONDecodeError told as the file it is in (found among the config's paths and `places`), where, and the fix."""
    fields = path_fields(config) if config is not None else {}
    path = json_file_with(err.doc, [*fields.values(), *places])
    where = f"line {err.lineno} column {err.colno}"
    if path is None:
        return f"a JSON file is not valid JSON ({err.msg} at {where}); expected valid JSON: fix the file"
    named = owner(path, config)
    under = f" (named by {named[0]}={named[1]!r})" if named else ""
    return f"{path}{under}: not valid JSON ({err.msg} at {where}); expected valid JSON: fix the file, or restore it"
