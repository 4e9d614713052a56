"""Markdown tables for artifacts, the gate's summary and eyas status (cells escaped: '|' and newlines)."""

from __future__ import annotations


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list]) -> str:
    """A Markdown table with this header row and these rows."""
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows])


def dict_table(rows: list[dict]) -> str:
    """A Markdown table of dicts (the first one's keys are the columns); `_(none)_` for no rows."""
    if not rows:
        return "_(none)_"
    cols = list(rows[0])
    return table(cols, [[r[c] for c in cols] for r in rows])
