"""Reports of ``kvq bench prefill``: a markdown table per context, the results file, and the speed/memory plot."""

from __future__ import annotations

from pathlib import Path

from .output import cache_style, context_axis, header_lines, pyplot, tables_by_context, with_ratio

MIB = 2**20
COLUMNS = ("method", "cache", "rep", "s", "forward s (waiting)", "eval s", "tokens/s (x kvcache)",
           "peak MiB above (x kvcache)", "KV MiB (x kvcache)")
NOTES = """Columns: s = wall time of the whole prefill (chunks of the settings' size, each chunk's cache state \
evaluated before the next, as mlx_lm.generate_step prefills; logits never computed); tokens/s = context / s; peak \
= mx.get_peak_memory() during the prefill minus the active memory before the caches were made; KV = the caches' \
nbytes afterwards (allocated, preallocation included). Ratios compare with kvcache (mlx-lm's KVCache in the model's \
dtype) in the same repetition; the first repetition includes compiling. forward s = time in the model's calls \
(building each chunk's graph; for kvq caches also queueing each layer's attention on the device and, in brackets, \
waiting there for the layer before); eval s = time in each chunk's mx.eval (the rest of the work, encoded and waited \
for). Where the waits and eval s are small against s, the host sets the pace, not the device. mlx-affine:N = mlx-lm's QuantizedKVCache \
(kv_bits N, group 64); the others are kvq caches."""


def _cells(r: dict) -> list[str]:
    head = [r["method"], r["cache"], str(r["rep"] + 1)]
    if r["error"]:
        return head + ["-", "-", "-", "-", "-", f"error: {r['error'][:120]}"]
    split = ["-", "-"] if r.get("forward_seconds") is None else [  # (results files before the split: none)
        f"{r['forward_seconds']:.3g} ({r['queue_wait_seconds']:.2g})", f"{r['eval_seconds']:.3g}"]
    return head + [f"{r['seconds']:.3g}", *split, with_ratio(f"{r['tokens_per_second']:,.0f}", r["speed_vs_fp16"]),
                   with_ratio(f"{r['peak_memory_growth'] / MIB:.1f}", r["peak_vs_fp16"]),
                   with_ratio(f"{r['kv_bytes'] / MIB:.1f}", r["kv_bytes_ratio"])]


def markdown(rows: list[dict]) -> str:
    """One table per context length (shortest first), then :data:`NOTES`."""
    return "\n".join(tables_by_context(rows, COLUMNS, _cells, "tokens of prompt") + [NOTES])


def markdown_file(document: dict) -> str:
    """A results file: title, exact command, device, versions, model and settings, then :func:`markdown`."""
    s = document["settings"]
    lines = [*header_lines("kvq bench prefill", document),
             f"Prompt: {s['prompt']}, chunks of {s['chunk']}, {s['reps']} repetitions; kvq caches: sinks {s['sinks']}, "
             f"window {s['window']}, flush {s['flush']}, kernels {s['kernels']}.", "", markdown(document["rows"])]
    return "\n".join(lines) + "\n"


def plot(document: dict, path: str | Path) -> None:
    """Two panels against prompt length (log 2): prefill tokens/s and peak memory above the model, the last
    repetition of each row; one line per method (kvcache dashed black, mlx-lm caches with squares).

    :raises ValueError: matplotlib is missing (the message says how to install it).
    """
    plt = pyplot()
    rows = [r for r in document["rows"] if not r["error"]]
    last = max((r["rep"] for r in rows), default=0)
    rows = [r for r in rows if r["rep"] == last]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = (("tokens_per_second", 1, "prefill tokens/s"), ("peak_memory_growth", MIB, "peak MiB above the model"))
    for ax, (key, scale, label) in zip(axes, panels):
        for method in dict.fromkeys(r["method"] for r in rows):
            points = sorted((r["context"], r[key] / scale) for r in rows if r["method"] == method)
            cache = next(r["cache"] for r in rows if r["method"] == method)
            ax.plot([p[0] for p in points], [p[1] for p in points], label=method, **cache_style(cache))
        ax.set(ylabel=label)
        context_axis(ax, "prompt length (tokens)")
    axes[0].legend(fontsize=8)
    env, m = document["environment"], document["model"]
    fig.suptitle(f"kvq bench prefill: {m['name']} ({m['dtype']}) on {env['device']}, MLX {env['mlx']}, "
                 f"repetition {last + 1}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
