"""Reports of ``kvq bench batch``: a markdown table per batch size, the results file, and the speed/memory plot."""

from __future__ import annotations

from pathlib import Path

from .output import cache_style, header_lines, markdown_table, pyplot, with_ratio

MIB = 2**20
COLUMNS = ("method", "cache", "rep", "prefill s; speed x kvcache", "decode tokens/s, all sequences (x kvcache)",
           "peak MiB above (x kvcache)")
NOTES = """Columns: prefill s = from inserting the prompts into mlx-lm's BatchGenerator until every sequence has its \
first token (speed x kvcache = the reference's seconds / these); decode tokens/s = every sequence's tokens after its first, over the time from then to the last token \
(the aggregate a server under concurrent load gives); peak = mx.get_peak_memory() during the run minus the active \
memory before the generator was made (caches, prefill and decode temporaries). Ratios compare with kvcache (mlx-lm's \
own caches, the model unpatched) in the same repetition; the first repetition includes compiling. kvq rows patch \
the model (kvq.patch_model), so the generator batches kvq caches (BatchKVQCache)."""


def _cells(r: dict) -> list[str]:
    head = [r["method"], r["cache"], str(r["rep"] + 1)]
    if r["error"]:
        return head + ["-", "-", f"error: {r['error'][:120]}"]
    speed = r["decode_tokens_per_second"]
    prefill = f"{r['prefill_seconds']:.3g}" + ("" if r["prefill_vs_fp16"] is None else f"; {r['prefill_vs_fp16']:.2f}x")
    return head + [prefill, with_ratio("-" if speed is None else f"{speed:,.1f}", r["decode_vs_fp16"]),
                   with_ratio(f"{r['peak_memory_growth'] / MIB:.1f}", r["peak_vs_fp16"])]


def markdown(rows: list[dict]) -> str:
    """One table per batch size (smallest first), then :data:`NOTES`."""
    parts = []
    for batch in sorted({r["batch"] for r in rows}):
        parts.append(f"### {batch} sequence{'' if batch == 1 else 's'} at once\n")
        parts.append(markdown_table(COLUMNS, [_cells(r) for r in rows if r["batch"] == batch]) + "\n")
    return "\n".join(parts + [NOTES])


def markdown_file(document: dict) -> str:
    """A results file: title, exact command, device, versions, model and settings, then :func:`markdown`."""
    s = document["settings"]
    lines = [*header_lines("kvq bench batch", document),
             f"Prompts: {s['prompt']} random tokens each, {s['tokens']} new tokens per sequence (greedy, no stop "
             f"token), prefill_step_size {s['chunk']}, {s['reps']} repetitions; kvq caches: sinks {s['sinks']}, "
             f"window {s['window']}, flush {s['flush']}, kernels {s['kernels']}.",
             *(f"Note: {n}" for n in document.get("notes", [])), "", markdown(document["rows"])]
    return "\n".join(lines) + "\n"


def plot(document: dict, path: str | Path) -> None:
    """Two panels against batch size (log 2): aggregate decode tokens/s and peak memory above the model, the last
    repetition of each row; one line per method (kvcache dashed black).

    :raises ValueError: matplotlib is missing (the message says how to install it).
    """
    plt = pyplot()
    rows = [r for r in document["rows"] if not r["error"] and r["decode_tokens_per_second"]]
    last = max((r["rep"] for r in rows), default=0)
    rows = [r for r in rows if r["rep"] == last]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = (("decode_tokens_per_second", 1, "decode tokens/s, all sequences"),
              ("peak_memory_growth", MIB, "peak MiB above the model"))
    for ax, (key, scale, label) in zip(axes, panels):
        for method in dict.fromkeys(r["method"] for r in rows):
            points = sorted((r["batch"], r[key] / scale) for r in rows if r["method"] == method)
            cache = next(r["cache"] for r in rows if r["method"] == method)
            name = f"{method} (mlx-lm's caches, {document['model']['dtype']})" if method in ("kvcache", "fp16") else method
            ax.plot([p[0] for p in points], [p[1] for p in points], label=name, **cache_style(cache))
        ax.set(ylabel=label, xlabel="sequences at once (BatchGenerator)")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(lambda v, _: f"{v:g}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    env, m = document["environment"], document["model"]
    fig.suptitle(f"kvq bench batch: {m['name']} ({m['dtype']}) on {env['device']}, MLX {env['mlx']}, "
                 f"{document['settings']['prompt']}-token prompts, repetition {last + 1}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
