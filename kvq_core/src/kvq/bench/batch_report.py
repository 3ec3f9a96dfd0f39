"""Reports of ``kvq bench batch``: a markdown table per batch size, the results file, and the speed/memory plot."""

from __future__ import annotations

from pathlib import Path

from .batch import summarize
from .output import cache_style, header_lines, markdown_table, median_range, pyplot, with_ratio

MIB = 2**20
COLUMNS = ("method", "cache", "timed reps", "prefill s", "prefill speed x kvcache",
           "decode tokens/s, all sequences", "decode x kvcache", "ceiling x kvcache", "step ms", "host ms/step",
           "build ms/step", "cache MiB (x kvcache)", "peak MiB above the start (x kvcache)")
NOTES = """Every cell: the median over the timed repetitions, then [min–max] where they differ, so the spread is the \
noise; the untimed warm-up repetitions (they compile kernels) are in neither. Columns: prefill s = from inserting the \
prompts into mlx-lm's BatchGenerator until every sequence has its first token (speed x kvcache = the reference's \
seconds / these); decode tokens/s = every sequence's tokens after its first, over the time from then to the last \
token (the aggregate a server under concurrent load gives); step ms = that time over the generator's decode steps \
(a mean); host ms/step = the median over a repetition's steps of the time from a step's tokens reaching Python to the next \
step being queued (the generator's and the model's Python, graph building and mx.async_eval, which on MLX's CUDA back \
end encodes it into CUDA graphs and can wait there for the device); build ms/step = its part before mx.async_eval \
is called: where the build is about the whole step, the host set the pace (on the CPU, where the host also \
computes the step, host time is the step, and a median can exceed the mean; kvq's pure-MLX attention, the CPU's \
path, starts its blocks of stored tokens one at a time and waits for the one before to bound memory, \
kvq.attention.run_block, so there its build includes computing: it is not all graph building); cache MiB = every \
sequence's caches, every layer, as allocated after the middle decode step (mlx-lm's \
BatchGenerator.prompt_cache_nbytes; caches grow in steps of tokens, so a step reads a little less); ceiling x \
kvcache = (weights + kvcache's cache bytes) / (weights + this row's), weights being those a step reads (the input \
embedding table left out where the model has an lm_head): the decode speed-up over kvcache that a step \
bound by memory bandwidth, reading the weights and every cache byte once, could reach (where the weights outweigh \
the caches, no cache can beat kvcache by much, whatever its bits); peak = \
mx.get_peak_memory() during the run minus the active memory before the generator was made (caches, prefill and \
decode temporaries). Ratios compare with kvcache (mlx-lm's own caches, the model unpatched) in the same \
repetition, measured first in each; the x kvcache columns are the medians of those per-repetition ratios. kvq rows \
patch the model (kvq.patch_model), so the generator batches kvq caches (BatchKVQCache)."""


def _cells(r: dict) -> list[str]:
    ok = r["reps"] - len(r["errors"])
    reps = str(ok) if not r["errors"] else f"{ok} of {r['reps']}; error: {r['errors'][0][:120]}"
    head = [r["method"], r["cache"], reps]
    if not ok:
        return head + ["-"] * (len(COLUMNS) - len(head))
    peak, ratio = r["peak_memory_growth"]["median"], r["peak_vs_fp16"]["median"]
    absent = {"median": None}  # build ms, cache bytes and the ceiling: absent from files before 2026-12-07
    cache, cache_ratio = ((r.get(key) or absent)["median"] for key in ("cache_bytes", "cache_vs_fp16"))
    cache_cell = "-" if cache is None else with_ratio(f"{cache / MIB:.1f}", cache_ratio)
    return head + [median_range(r["prefill_seconds"]), median_range(r["prefill_vs_fp16"], ".2f"),
                   median_range(r["decode_tokens_per_second"], ",.1f"), median_range(r["decode_vs_fp16"], ".2f"),
                   median_range(r.get("ceiling_vs_fp16") or absent, ".2f"),
                   median_range(r["step_ms"]), median_range(r["host_ms"]), median_range(r.get("build_ms") or absent),
                   cache_cell,
                   with_ratio(f"{peak / MIB:.1f}", ratio)]


def markdown(rows: list[dict]) -> str:
    """One table per batch size (smallest first) of :func:`kvq.bench.batch.summarize`'s medians and ranges over
    ``rows`` (the timed repetitions), then :data:`NOTES`."""
    summary = summarize(rows)
    parts = []
    for batch in sorted({r["batch"] for r in summary}):
        parts.append(f"### {batch} sequence{'' if batch == 1 else 's'} at once\n")
        parts.append(markdown_table(COLUMNS, [_cells(r) for r in summary if r["batch"] == batch]) + "\n")
    return "\n".join(parts + [NOTES])


def prompt_lengths(settings: dict) -> str:
    """``"2048"`` or, with ``--shortest``, ``"2048 down to 256 (evenly spaced)"``: the prompts' lengths in a results
    file's ``settings`` (files before ``--shortest`` have no such key)."""
    shortest = settings.get("shortest")
    if shortest is None or shortest == settings["prompt"]:
        return str(settings["prompt"])
    return f"{settings['prompt']} down to {shortest} (evenly spaced)"


def markdown_file(document: dict) -> str:
    """A results file: title, exact command, device, versions, model and settings, then :func:`markdown`."""
    s = document["settings"]
    lengths = prompt_lengths(s)
    each = " each" if lengths == str(s["prompt"]) else ""
    lines = [*header_lines("kvq bench batch", document),
             f"Prompts: {lengths} random tokens{each}, {s['tokens']} new tokens per sequence (greedy, no stop "
             f"token), prefill_step_size {s['chunk']}, {s.get('warmup', 0)} untimed warm-up and {s['reps']} timed "
             f"repetitions; kvq caches: sinks {s['sinks']}, window {s['window']}, flush {s['flush']}, kernels "
             f"{s['kernels']}.",
             *(f"Note: {n}" for n in document.get("notes", [])), "", markdown(document["rows"])]
    return "\n".join(lines) + "\n"


def plot(document: dict, path: str | Path) -> None:
    """Two panels against batch size (log 2): aggregate decode tokens/s and peak memory above the model, the median
    over the timed repetitions with a bar from their min to their max; one line per method (kvcache dashed black).

    :raises ValueError: matplotlib is missing (the message says how to install it).
    """
    plt = pyplot()
    summary = [r for r in summarize(document["rows"]) if r["decode_tokens_per_second"]["median"]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = (("decode_tokens_per_second", 1, "decode tokens/s, all sequences"),
              ("peak_memory_growth", MIB, "peak MiB above the model"))
    for ax, (key, scale, label) in zip(axes, panels):
        for method in dict.fromkeys(r["method"] for r in summary):
            points = sorted((r["batch"], r[key]) for r in summary if r["method"] == method)
            x, values = [p[0] for p in points], [p[1] for p in points]
            y = [v["median"] / scale for v in values]
            bars = [[m - v["min"] / scale for m, v in zip(y, values)],
                    [v["max"] / scale - m for m, v in zip(y, values)]]
            cache = next(r["cache"] for r in summary if r["method"] == method)
            name = f"{method} (mlx-lm's caches, {document['model']['dtype']})" if method in ("kvcache", "fp16") else method
            ax.errorbar(x, y, yerr=bars, capsize=3, label=name, **cache_style(cache))
        ax.set(ylabel=label, xlabel="sequences at once (BatchGenerator)")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(lambda v, _: f"{v:g}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    env, m, s = document["environment"], document["model"], document["settings"]
    fig.suptitle(f"kvq bench batch: {m['name']} ({m['dtype']}) on {env['device']}, MLX {env['mlx']}, "
                 f"prompts of {prompt_lengths(s)} tokens, median of {s['reps']} repetitions (bars: min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
