"""Reports of ``kvq bench capacity``: the markdown table, the results file and the bar plot."""

from __future__ import annotations

from pathlib import Path

from .output import header_lines, markdown_table, median_range, pyplot, with_ratio

MIB = 2**20
COLUMNS = ("method", "sequences that fit (x kvcache)", "per sequence MiB", "peak MiB / budget",
           "decode tokens/s, all sequences (x kvcache)", "ms/step", "host ms/step", "build ms/step")
NOTES = """Columns: sequences that fit = the largest batch of sequences of this length measured whose peak (model, \
caches, decode temporaries) stayed within the budget in every timed repetition, the batches tried being those a line through measured peaks \
predicts within the safety fraction of the headroom (the tries are in the JSON); ">= N" where --max-batch capped \
it; per sequence = the peak's growth from 1 to 2 sequences (one \
more sequence's cache and temporaries); peak = the largest of the repetitions at that batch; tokens/s = sequences / \
mean step over the timed steps (flushes included), as kvq bench e2e --batch, and ms/step that mean step; host \
ms/step = the median step's time from its tokens reaching Python to the next step being queued \
(mx.async_eval returning, which on MLX's CUDA back end can wait for the device), build ms/step the part before \
mx.async_eval is called (Python and graph building): where the build is about the whole step, the host set the \
pace. The decode at the chosen batch is timed --reps times (the row that showed \
it fits, then more at that batch): each speed cell is the median, then [min–max] where they differ, so the spread \
is the noise; every repetition is in the JSON. Every row holds random keys and values; ratios compare medians with \
kvcache (mlx-lm's KVCache) in the same run."""


def _cells(r: dict) -> list[str]:
    if r["error"]:
        return [r["method"], "-", "-", "-", f"error: {r['error'][:160]}", "-", "-", "-"]
    fit = (">= " if r.get("at_max_batch") else "") + str(r["max_batch"])
    failed = [x["error"] for x in r["reps"] if x["error"]]  # files written before a failed repetition ended a try
    speed = median_range(r["tokens_per_second_spread"], ",.1f")
    speed += f"; {len(failed)} of {len(r['reps'])} reps failed: {failed[0][:80]}" if failed else ""
    return [r["method"], with_ratio(fit, r["batch_vs_fp16"]),
            f"{r['per_sequence_bytes'] / MIB:,.1f}", f"{r['peak_memory'] / MIB:,.0f} / {r['budget'] / MIB:,.0f}",
            with_ratio(speed, r["tokens_vs_fp16"]), median_range(r["step_ms"], ".2f"), median_range(r["host_ms"]),
            median_range(r.get("build_ms") or {"median": None})]  # absent before 2026-12-07


def markdown(rows: list[dict]) -> str:
    """The table, then :data:`NOTES`."""
    return "\n".join([markdown_table(COLUMNS, [_cells(r) for r in rows]) + "\n", NOTES])


def markdown_file(document: dict) -> str:
    """A results file: title, exact command, device, versions, model and settings, then :func:`markdown`."""
    s = document["settings"]
    lines = [*header_lines("kvq bench capacity", document),
             f"Sequences of {s['context']} tokens, budget {s['budget'] / MIB:,.0f} MiB, safety {s['safety']}, "
             f"{s['steps']} timed steps, {s.get('reps', 1)} timed decodes at the chosen batch; kvq caches: sinks "
             f"{s['sinks']}, window {s['window']}, flush {s['flush']}, kernels {s['kernels']}.",
             *(f"Note: {n}" for n in document.get("notes", [])), "", markdown(document["rows"])]
    return "\n".join(lines) + "\n"


def plot(document: dict, path: str | Path) -> None:
    """Two bar panels per method: sequences that fit, and their aggregate decode tokens/s (the median of the
    repetitions, a line from their min to their max).

    :raises ValueError: matplotlib is missing (the message says how to install it).
    """
    plt = pyplot()
    rows = [r for r in document["rows"] if not r["error"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [r["method"] for r in rows]
    colors = ["black" if n in ("kvcache", "fp16") else "tab:blue" for n in names]
    spreads = [r["tokens_per_second_spread"] for r in rows]
    bars = [[v["median"] - v["min"] for v in spreads], [v["max"] - v["median"] for v in spreads]]
    axes[0].bar(names, [r["max_batch"] for r in rows], color=colors)
    axes[1].bar(names, [r["tokens_per_second"] for r in rows], color=colors, yerr=bars, capsize=4, ecolor="tab:red")
    for ax, label in ((axes[0], "sequences that fit"), (axes[1], "decode tokens/s, all sequences (median, min-max)")):
        ax.set(ylabel=label)
        ax.tick_params(axis="x", rotation=20)
        ax.grid(True, axis="y", alpha=0.3)
    env, m, s = document["environment"], document["model"], document["settings"]
    fig.suptitle(f"kvq bench capacity: {m['name']} ({m['dtype']}) on {env['device']}, {s['context']}-token "
                 f"sequences, budget {s['budget'] / MIB:,.0f} MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
