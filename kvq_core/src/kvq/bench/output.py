"""Writing benchmark results, shared by the ``kvq bench`` subcommands: file names, JSON, markdown tables, pyplot.

A result is a JSON document ``{"benchmark", "environment", "settings", "rows", ...}`` written after every row
(so a run cut short still leaves what it measured), a markdown table, and PNG plots.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

from ..install_hints import install_command


def output_paths(out: str | Path, stem: str, suffixes: Sequence[str] = (".json", ".md", ".png")) -> dict[str, Path]:
    """``{".json": out/stem.json, ...}``; creates the folder ``out``.

    :raises ValueError: ``out`` exists and is not a folder, or ``stem`` is empty or contains a path separator.
    """
    if not stem or "/" in stem or "\\" in stem:
        raise ValueError(f"--name must be a file name without folders; got {stem!r}")
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    return {suffix: folder / f"{stem}{suffix}" for suffix in suffixes}


def unused_stem(out: str | Path, stem: str, suffixes: Sequence[str] = (".json", ".md", ".png")) -> str:
    """``stem``, or ``stem-2``, ``stem-3`` ... the first whose files (``out/stem.json`` ...) do not exist yet: a
    default result name never overwrites an earlier run's files."""
    def taken(name: str) -> bool:
        return any((Path(out) / f"{name}{suffix}").exists() for suffix in suffixes)

    n, free = 1, stem
    while taken(free):
        n += 1
        free = f"{stem}-{n}"
    return free


def slug(text: str) -> str:
    """``"random:llama3-8b"`` -> ``"random-llama3-8b"``: lower case, runs of other characters as one ``-``."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "model"


def write_json(document: dict[str, Any], path: str | Path) -> None:
    """Write ``document`` as indented JSON (through a temporary file, so a reader never sees half of it)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    tmp.replace(path)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; cells are formatted with ``str`` and ``|`` in them is escaped."""
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(headers), "|" + "---|" * len(headers), *(line(r) for r in rows)])


def plots_extra() -> str:
    """How to get matplotlib, which kvq-core installs only with its ``plots`` extra (a command that works here)."""
    return install_command("kvq-core", extra="plots")


def pyplot():
    """matplotlib's pyplot on the Agg back end (no display needed).

    :raises ValueError: matplotlib does not import (the message names the install command and ``--no-plot``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError(f"the PNG plots need matplotlib ({exc}): {plots_extra()}; or pass --no-plot") from None
    return plt
