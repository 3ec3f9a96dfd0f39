"""Reports of ``kvq bench capacity``: the markdown table, the results file and the bar plot."""

from __future__ import annotations

from pathlib import Path

from .output import header_lines, markdown_table, pyplot, with_ratio

MIB = 2**20
COLUMNS = ("method", "sequences that fit (x kvcache)", "per sequence MiB", "peak MiB / budget",
           "decode tokens/s, all sequences (x kvcache)", "ms/step")
NOTES = """Columns: sequences that fit = the largest batch of sequences of this length measured whose peak (model, \
caches, decode temporaries) stayed within the budget, the batches tried being those a line through measured peaks \
predicts within the safety fraction of the headroom (the tries are in the JSON); ">= N" where --max-batch capped \
it; per sequence = the peak's growth from 1 to 2 sequences (one \
more sequence's cache and temporaries); tokens/s = sequences / mean step over the timed steps (flushes included), \
as kvq bench e2e --batch. Every row holds random keys and values; ratios compare with kvcache (mlx-lm's KVCache) in \
the same run."""


def _cells(r: dict) -> list[str]:
    if r["error"]:
        return [r["method"], "-", "-", "-", f"error: {r['error'][:160]}", "-"]
    ms = r["row"]["latency_ms"]["mean"]
    fit = (">= " if r.get("at_max_batch") else "") + str(r["max_batch"])
    return [r["method"], with_ratio(fit, r["batch_vs_fp16"]),
            f"{r['per_sequence_bytes'] / MIB:,.1f}", f"{r['peak_memory'] / MIB:,.0f} / {r['budget'] / MIB:,.0f}",
            with_ratio(f"{r['tokens_per_second']:,.1f}", r["tokens_vs_fp16"]), f"{ms:.2f}"]


def markdown(rows: list[dict]) -> str:
    """The table, then :data:`NOTES`."""
    return "\n".join([markdown_table(COLUMNS, [_cells(r) for r in rows]) + "\n", NOTES])


def markdown_file(document: dict) -> str:
    """A results file: title, exact command, device, versions, model and settings, then :func:`markdown`."""
    s = document["settings"]
    lines = [*header_lines("kvq bench capacity", document),
             f"Sequences of {s['context']} tokens, budget {s['budget'] / MIB:,.0f} MiB, safety {s['safety']}, "
             f"{s['steps']} timed steps; kvq caches: sinks {s['sinks']}, window {s['window']}, flush {s['flush']}, "
             f"kernels {s['kernels']}.", "", markdown(document["rows"])]
    return "\n".join(lines) + "\n"


def plot(document: dict, path: str | Path) -> None:
    """Two bar panels per method: sequences that fit, and their aggregate decode tokens/s.

    :raises ValueError: matplotlib is missing (the message says how to install it).
    """
    plt = pyplot()
    rows = [r for r in document["rows"] if not r["error"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [r["method"] for r in rows]
    for ax, key, label in ((axes[0], "max_batch", "sequences that fit"),
                           (axes[1], "tokens_per_second", "decode tokens/s, all sequences")):
        ax.bar(names, [r[key] for r in rows], color=["black" if n in ("kvcache", "fp16") else "tab:blue" for n in names])
        ax.set(ylabel=label)
        ax.tick_params(axis="x", rotation=20)
        ax.grid(True, axis="y", alpha=0.3)
    env, m, s = document["environment"], document["model"], document["settings"]
    fig.suptitle(f"kvq bench capacity: {m['name']} ({m['dtype']}) on {env['device']}, {s['context']}-token "
                 f"sequences, budget {s['budget'] / MIB:,.0f} MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
