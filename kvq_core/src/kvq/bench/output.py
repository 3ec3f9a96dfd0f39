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


def with_ratio(text: str, ratio: float | None) -> str:
    """A table cell: ``text``, followed by `` (ratio)`` to two decimals unless ``ratio`` is ``None`` (a row or its
    reference failed)."""
    return text if ratio is None else f"{text} ({ratio:.2f})"


def uncompressed_note(what: str, tokens: int, sinks: int, window: int, flush: int, option: str) -> list[str]:
    """The note a run needs when its sequences (``what``, ``tokens`` long at the end) never grow past a kvq cache's
    ``sinks`` and ``window`` (+ ``flush - 1`` before a flush): nothing is compressed, so its kvq rows measure
    16-bit caches; ``option`` is the length option to raise. ``[]`` otherwise."""
    from ..cache.schedule import first_flush

    if tokens >= first_flush(sinks, window, flush):
        return []
    return [f"{what} stay within the kvq caches' {sinks} sinks and {window}-token window (+ {flush - 1} before a "
            f"flush): nothing is compressed; use a longer {option} or a smaller --window"]


def median_range(values: dict[str, Any], spec: str = ".3g", scale: float = 1.0) -> str:
    """A table cell of repeated measurements (:func:`kvq.bench.rows.spread`'s ``{"median", "min", "max"}``, each
    divided by ``scale``, formatted with ``spec``): ``median [min–max]`` (brackets: the parentheses of a table are
    its ratios), the median alone when all are equal, ``-`` without any value."""
    if values["median"] is None:
        return "-"
    median, low, high = (format(values[k] / scale, spec) for k in ("median", "min", "max"))
    return median if low == high else f"{median} [{low}–{high}]"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; cells are formatted with ``str`` and ``|`` in them is escaped."""
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(headers), "|" + "---|" * len(headers), *(line(r) for r in rows)])


def tables_by_context(rows: Sequence[dict], headers: Sequence[str], cells, heading: str) -> list[str]:
    """One markdown table per ``row["context"]`` (shortest first), each under ``### {context} {heading}``;
    ``cells(row)`` gives a row's cells."""
    parts = []
    for context in sorted({r["context"] for r in rows}):
        parts.append(f"### {context} {heading}\n")
        parts.append(markdown_table(headers, [cells(r) for r in rows if r["context"] == context]) + "\n")
    return parts


def header_lines(title: str, document: dict[str, Any]) -> list[str]:
    """The first lines of a results file: ``# {title}, date``, the exact command, the device and versions (and
    git commit), and the model (``document["environment"]`` and ``["model"]``)."""
    env, m = document["environment"], document["model"]
    commit = env.get("git_commit")
    return [f"# {title}, {env['date']}", "", f"`{env['command']}`", "",
            f"Device: {env['device']} ({env['device_kind']}); MLX {env['mlx']}, kvq {env['kvq']}"
            + (f", git {commit[:10]}{' (modified tree)' if env.get('git_dirty') else ''}" if commit else "") + ".",
            f"Model: {m['name']} ({m['layers']} layers, {m['q_heads']} query / {m['kv_heads']} KV heads, head_dim "
            f"{m['head_dim']}, {m['dtype']}, {m['parameters'] / 1e6:.0f}M parameters)."]


def context_axis(ax, label: str = "context length (tokens)") -> None:
    """A matplotlib x axis of token counts: log 2, ticks as 1K, 4K ... (plain below 1024), a light grid."""
    ax.set_xlabel(label)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(lambda v, _: f"{v / 1024:g}K" if v >= 1024 else f"{v:g}")
    ax.grid(True, which="both", alpha=0.3)


def cache_style(cache: str) -> dict[str, str]:
    """matplotlib line style of a row's ``cache`` kind: mlx-lm's KVCache (kvcache, the reference) dashed black,
    mlx-lm's other caches with squares, kvq's with dots."""
    if cache == "mlx-lm KVCache":
        return dict(color="black", linestyle="--", marker="o")
    return dict(marker="s" if cache.startswith("mlx-lm") else "o")


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
