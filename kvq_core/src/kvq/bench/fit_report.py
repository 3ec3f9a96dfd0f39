"""Reports of ``kvq fit``: the rows, the terminal table and the bar plot."""

from __future__ import annotations

from pathlib import Path

from .fit import ENCODE_WORK, FIXED_OVERHEAD, Budget, CacheCost
from .output import markdown_table, pyplot

MIB, GIB = 2**20, 2**30
COLUMNS = ("cache", "bits per coordinate", "KiB per token", "longest context, {batch} sequence(s)",
           "sequences of {context} tokens")



def size_unit(n: int) -> tuple[float, str]:
    """``n`` bytes as ``(value, unit)`` in the largest of GiB, MiB, KiB that leaves at least 1 (``n`` and ``"B"``
    below 1 KiB): a small ``--memory`` read "0.00 GiB" in GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return n / size, unit
    return n, "B"


def size_text(n: int) -> str:
    """``n`` bytes in :func:`size_unit`'s unit: ``"1.50 GiB"``, ``"512.00 KiB"``, ``"100 B"``."""
    value, unit = size_unit(n)
    return f"{value:,.2f} {unit}" if unit != "B" else f"{n} B"


def row(budget: Budget, cost: CacheCost, context: int, batch: int) -> dict:
    """One cache's answers: ``longest`` (tokens, ``batch`` sequences), ``sequences`` (of ``context`` tokens), the
    bytes behind them (``per_sequence_bytes`` at ``context``, ``fixed_bytes``) and its bits per coordinate."""
    s = budget.shape
    per_token = sum(cost.resident(context, s.kv_heads, s.head_dim) for _ in range(s.layers)) / context
    return {"method": cost.label, "cache": cost.kind, "bits_per_coordinate": cost.bits_per_token / (2 * s.head_dim),
            "bytes_per_token": per_token, "longest": budget.longest(cost, batch),
            "sequences": budget.sequences(cost, context), "per_sequence_bytes": budget.per_sequence(cost, context),
            "fixed_bytes": budget.fixed(cost), "sinks": cost.sinks, "window": cost.window, "flush": cost.flush}


def _cells(r: dict, reference: dict) -> list[str]:
    def ratio(key):
        return f" ({r[key] / reference[key]:.2f})" if reference[key] else ""

    return [r["method"], f"{r['bits_per_coordinate']:.2f}", f"{r['bytes_per_token'] / 1024:,.1f}",
            f"{r['longest']:,}{ratio('longest')}", f"{r['sequences']:,}{ratio('sequences')}"]


def markdown(document: dict) -> str:
    """The table (ratios to kvcache in brackets), then what the numbers are made of."""
    s, rows = document["settings"], document["rows"]
    headers = [c.format(batch=s["batch"], context=s["context"]) for c in COLUMNS]
    m = document["model"]
    lines = [markdown_table(headers, [_cells(r, rows[0]) for r in rows]), "",
             f"{m['name']}: {m['layers']} layers, {m['kv_heads']} KV heads, head_dim {m['head_dim']}, {m['dtype']}; "
             f"weights {size_text(m['weight_bytes'])}. Memory {size_text(s['memory'])} ({s['memory_source']}), "
             f"safety {s['safety']}, chunk {s['chunk']} tokens; fixed term {FIXED_OVERHEAD / MIB:g} MiB plus the "
             "methods' shared constants."]
    if s.get("device") == "cpu":
        cpu, gpu = ENCODE_WORK["cpu"], ENCODE_WORK["gpu"][None]
        lines.append(f"Counted for the CPU: a chunk's encoding holds float32 work per sequence (turboquant {cpu[None]} "
                     f"bytes per coordinate of the chunk, affine {cpu['affine']}), which can let a cache of fewer bits "
                     f"fit fewer sequences here; --device gpu predicts for a GPU's fused encoders ({gpu}).")
    if m["weight_bytes"] >= s["memory"]:
        lines.append(f"NOTE: the weights alone ({size_text(m['weight_bytes'])}) do not fit in "
                     f"{size_text(s['memory'])}: no cache fits (give --memory the memory of the machine to run on).")
    elif not any(r["longest"] for r in rows):
        lines.append("NOTE: no cache fits one token beside the weights and the fixed term in this memory.")
    if m["max_context"] and any(r["longest"] > m["max_context"] for r in rows):
        lines.append(f"The model's max_position_embeddings is {m['max_context']:,} tokens: longer contexts fit in "
                     "memory but the model was not trained for them.")
    return "\n".join(lines)


def plot(document: dict, path: str | Path) -> None:
    """Two bar panels per cache: the longest context, and the sequences of ``--context`` tokens.

    :raises ValueError: matplotlib is missing (the message says how to install it).
    """
    plt = pyplot()
    rows, s = document["rows"], document["settings"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [r["method"] for r in rows]
    for ax, key, label in ((axes[0], "longest", f"longest context, {s['batch']} sequence(s) (tokens)"),
                           (axes[1], "sequences", f"sequences of {s['context']:,} tokens")):
        ax.bar(names, [r[key] for r in rows], color=["black" if r["cache"] == "mlx-lm" else "tab:blue" for r in rows])
        ax.set(ylabel=label)
        ax.tick_params(axis="x", rotation=20)
        ax.grid(True, axis="y", alpha=0.3)
    m = document["model"]
    fig.suptitle(f"kvq fit: {m['name']} ({m['dtype']}) in {s['memory'] / GIB:,.1f} GiB (predicted)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
