"""Reports of ``kvq bench e2e``: a markdown table per context, the results file, and the speed/memory plot."""

from __future__ import annotations

from pathlib import Path

from .output import cache_style, context_axis, header_lines, pyplot, tables_by_context, with_ratio

MIB = 2**20
COLUMNS = ("method", "cache", "bits/coord (eff.)", "KV MiB (x kvcache)", "measured MiB (x kvcache)", "decode peak MiB",
           "ms/step mean, median [p10, p90]", "host ms/step median (build)", "tokens/s (x kvcache)", "attend")
NOTES = """Columns: bits/coord = stored bits per coordinate of compressed tokens (codes + norms + scales), keys and \
values averaged; eff. = over the whole context with a kvq cache's sinks and window at 16 bits. KV MiB = the caches' \
nbytes after the fill (allocated, preallocation included); measured = growth of mx.get_active_memory() from before \
the caches were made to after the fill; decode peak = mx.get_peak_memory() during decode minus the memory before \
the caches were made (caches + decode temporaries). ms/step: one decode step (one greedy token for each \
sequence: one, or the --batch count), the steps pipelined as mlx_lm.generate runs them, after the warmup steps; \
host ms/step = the time Python spent building the next step's graph and MLX queueing it (mx.async_eval, which \
on MLX's CUDA back end encodes it into CUDA graphs and can wait there for the device), and in brackets the build \
alone (before mx.async_eval): where the build is about the whole step, the host set the pace; a host time about \
the whole step with a short build is a wait for the device (benchmarks/decode_host_split.py splits it further; on \
the CPU host and step come out equal); tokens/s = sequences / mean step \
(a kvq cache's window flush, once every flush steps, counts). \
kvcache = mlx-lm's KVCache in the model's dtype, the reference (fp16 in older files); mlx-affine:N = mlx-lm's QuantizedKVCache (kv_bits N, group 64); the \
others are kvq caches."""


def _batch(settings: dict) -> str:
    batch = settings.get("batch", 1)  # absent from results written before batches were measured
    return "" if batch == 1 else f" of {batch} sequences at once (tokens/s counts every sequence's token)"


def _rounds(settings: dict) -> str:
    rounds = settings.get("rounds", 1)  # absent from results written before rounds were measured
    return "" if rounds == 1 else (f" per round, {rounds} rounds with the caches held at once and taking turns "
                                   f"(order reversed every round; later rounds 1 warmup step)")


def _host(r: dict) -> str:
    host = (r.get("host_ms") or {}).get("median")  # absent from results written before it was measured
    build = (r.get("build_ms") or {}).get("median")  # absent before 2026-12-07
    return "-" if host is None else f"{host:.3g}" + ("" if build is None else f" ({build:.3g})")


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _cells(r: dict) -> list[str]:
    head = [r["method"], r["cache"], f"{r['bits_per_coordinate']:.3g} ({r['effective_bits_per_coordinate']:.3g})"]
    if r["error"]:
        return head + ["-"] * (len(COLUMNS) - 4) + [f"error: {r['error'][:120]}"]
    lat = r["latency_ms"]
    speed = with_ratio(_rate(r["tokens_per_second"]), r["speed_vs_fp16"])
    return head + [with_ratio(f"{r['kv_bytes'] / MIB:.1f}", r["kv_bytes_ratio"]),
                   with_ratio(f"{r['active_memory_growth'] / MIB:.1f}", r["memory_ratio"]),
                   f"{r['peak_memory_growth'] / MIB:.1f}",
                   f"{lat['mean']:.3g}, {lat['median']:.3g} [{lat['p10']:.3g}, {lat['p90']:.3g}]", _host(r), speed,
                   r["attend_implementation"] or "mlx-lm"]


def markdown(rows: list[dict]) -> str:
    """One table per context length (shortest first), then :data:`NOTES`."""
    batch = max((r.get("batch", 1) for r in rows), default=1)  # absent from results written before batches
    heading = "tokens of context" + (f", {batch} sequences at once" if batch > 1 else "")
    return "\n".join(tables_by_context(rows, COLUMNS, _cells, heading) + [NOTES])


def markdown_file(document: dict) -> str:
    """A results file: title, exact command, device, versions, model and settings, then :func:`markdown`."""
    s = document["settings"]
    lines = [*header_lines("kvq bench e2e", document),
             f"Fill: {s['fill']} (chunks of {s['chunk']}); decode: {s['warmup']} warmup + {s['steps']} timed steps"
             f"{_batch(s)}{_rounds(s)}; "
             f"kvq caches: sinks {s['sinks']}, window {s['window']}"
             f"{'' if s.get('flush') is None else ', flush ' + str(s['flush'])}, kernels {s['kernels']}.",
             *(f"Note: {n}" for n in document.get("notes", [])), "", markdown(document["rows"])]
    return "\n".join(lines) + "\n"


def plot(document: dict, path: str | Path) -> None:
    """Three panels against context length (log 2): decode tokens/s, measured KV memory, decode peak memory;
    one line per method (kvcache dashed black, mlx-lm caches with squares).

    :raises ValueError: matplotlib is missing (the message says how to install it).
    """
    plt = pyplot()
    from matplotlib.ticker import LogFormatter

    rows = [r for r in document["rows"] if not r["error"]]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    panels = (("tokens_per_second", 1, "decode tokens/s (1 / mean latency)"),
              ("active_memory_growth", MIB, "KV memory, measured (MiB)"),
              ("peak_memory_growth", MIB, "decode peak memory above the pre-cache level (MiB)"))
    for ax, (key, scale, label) in zip(axes, panels):
        for method in dict.fromkeys(r["method"] for r in rows):
            points = sorted((r["context"], r[key] / scale) for r in rows if r["method"] == method)
            cache = next(r["cache"] for r in rows if r["method"] == method)
            name = f"{method} (mlx-lm KVCache, {rows[0]['kv_dtype']})" if cache == "mlx-lm KVCache" else method
            ax.plot([p[0] for p in points], [p[1] for p in points], label=name, **cache_style(cache))
        ax.set(yscale="log", ylabel=label)
        context_axis(ax)
        ax.yaxis.set_major_formatter(LogFormatter())  # plain numbers; minor ticks labelled on short ranges
        ax.yaxis.set_minor_formatter(LogFormatter())
    axes[0].legend(fontsize=8)
    env, m = document["environment"], document["model"]
    squares = any("QuantizedKVCache" in r["cache"] for r in rows)
    fig.suptitle(f"kvq bench e2e: {m['name']} ({m['dtype']}) on {env['device']}, MLX {env['mlx']}"
                 + (" (squares: mlx-lm's QuantizedKVCache)" if squares else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
