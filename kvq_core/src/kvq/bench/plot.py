"""PNG plots of ``kvq bench ops``: time against size per op, one line per (method, implementation), log-log."""

from __future__ import annotations

from pathlib import Path

from .output import pyplot


def _lines(rows: list[dict], op: str) -> dict[str, list[tuple[int, float]]]:
    lines: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        if row["op"] == op:
            label = f"{row['method']} mx.fast SDPA" if row["implementation"] == "mx.fast.sdpa" else \
                f"{row['method']} {row['implementation']}"
            lines.setdefault(label, []).append((row["size"], row["median_s"] * 1e3))
    return lines


def plot_ops(rows: list[dict], out_dir: str | Path, device: str) -> list[str]:
    """One PNG per op in ``rows``: ``ops_<op>.png`` in ``out_dir``, median ms against size (vectors for
    quantize/dequantize, context tokens for attend), log-log.

    :return: the paths written. :raises ValueError: matplotlib is missing (the message says how to install it).
    """
    plt = pyplot()
    written = []
    for op in dict.fromkeys(r["op"] for r in rows):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, points in sorted(_lines(rows, op).items()):
            points.sort()
            style = dict(color="black", linestyle="--") if label.endswith(" mx.fast SDPA") else {}
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label, **style)
        unit = "context length T (tokens)" if op == "attend" else "N (vectors)"
        ax.set(xscale="log", yscale="log", xlabel=unit, ylabel="median time per call (ms)",
               title=f"kvq {op} on {device}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        path = Path(out_dir) / f"ops_{op}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    return written
