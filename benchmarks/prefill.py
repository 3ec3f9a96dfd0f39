"""Prefill speed and peak memory of kvq caches against mlx-lm's KVCache, in one process (issue #23).

    python benchmarks/prefill.py OUT_DIR [--model random:llama3-8b] [--contexts 8K,32K] [--chunk 2048]
        [--methods fp16,turboquant:3,turboquant:4,affine:4] [--reps 2] [--dtype bfloat16]

For each context and repetition, every cache prefills the same random prompt through the model in chunks of
``--chunk`` tokens (mlx-lm's default 2048), each chunk evaluated before the next (as mlx-lm's generate_step does).
Reported per row: seconds, prefill tokens/s, its ratio to fp16's in the same repetition, and the peak memory above
the model during the prefill (``mx.get_peak_memory`` after ``mx.reset_peak_memory``), with its ratio to fp16's.
Writes OUT_DIR/prefill.json (after every row), OUT_DIR/prefill.md and OUT_DIR/prefill.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx


def _size(text: str) -> int:
    text = text.strip().upper()
    return int(float(text[:-1]) * 1024) if text.endswith("K") else int(text)


def make_caches(model, label: str):
    from mlx_lm.models.cache import make_prompt_cache as mlx_cache

    from kvq.evaluation.spec import make_cache, parse_method

    if label == "fp16":
        return mlx_cache(model)
    return make_cache(model, parse_method(label), sinks=4, window=128)


def prefill_once(model, caches, ids: mx.array, chunk: int) -> tuple[float, float]:
    """``(seconds, peak bytes above the start)`` of one chunked prefill of ``ids`` (1-D)."""
    from kvq.bench.fill import cache_arrays

    gc.collect()
    mx.clear_cache()
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    tic = time.perf_counter()
    for start in range(0, ids.size, chunk):
        model(ids[None, start : start + chunk], cache=caches)
        mx.eval([cache_arrays(c) for c in caches])
    mx.synchronize()
    return time.perf_counter() - tic, mx.get_peak_memory() - base


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--contexts", default="8K,32K")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--methods", default="fp16,turboquant:3,turboquant:4,affine:4")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--layers", type=int, default=None, help="keep this many layers of the random preset")
    ap.add_argument("--inflight-bytes", type=int, default=None,
                    help="set KVQCache.PREFILL_INFLIGHT_BYTES (0: each layer's chunk attention evaluated in turn)")
    args = ap.parse_args(argv)

    import kvq
    from kvq.bench.random_model import build_random_model, random_config

    if args.inflight_bytes is not None:
        from kvq.cache import KVQCache

        KVQCache.PREFILL_INFLIGHT_BYTES = args.inflight_bytes
    args.out.mkdir(parents=True, exist_ok=True)
    config = random_config(args.model, args.layers)
    model = build_random_model(config, getattr(mx, args.dtype))
    methods = [m.strip() for m in args.methods.split(",")]
    rows = []
    doc = {"model": args.model, "layers": config["num_hidden_layers"], "dtype": args.dtype, "chunk": args.chunk,
           "device": str(mx.default_device()), "mlx": mx.__version__, "kvq": kvq.__version__,
           "python": platform.python_version(), "inflight_bytes": args.inflight_bytes, "rows": rows}
    try:
        import kvq_metal

        doc["kernel_sources"] = kvq_metal.sources_hash()
    except ImportError:
        pass
    for context in [_size(c) for c in args.contexts.split(",")]:
        ids = mx.random.randint(0, config["vocab_size"], (context,), key=mx.random.key(context))
        for rep in range(args.reps):
            fp16_row = None
            for label in methods:
                caches = make_caches(model, label)
                seconds, peak = prefill_once(model, caches, ids, args.chunk)
                row = {"context": context, "rep": rep, "method": label, "seconds": seconds,
                       "tokens_per_second": context / seconds, "peak_bytes": peak}
                if label == "fp16":
                    fp16_row = row
                elif fp16_row is not None:
                    row["speed_vs_fp16"] = row["tokens_per_second"] / fp16_row["tokens_per_second"]
                    row["peak_vs_fp16"] = peak / fp16_row["peak_bytes"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                (args.out / "prefill.json").write_text(json.dumps(doc, indent=1))
                del caches
    lines = [f"Prefill, {args.model} ({config['num_hidden_layers']} layers, {args.dtype}), chunks of {args.chunk}, "
             f"{doc['device']}, MLX {doc['mlx']}", "",
             "| context | rep | cache | s | tokens/s | x fp16 | peak GB above model | x fp16 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context'] // 1024}K | {r['rep']} | {r['method']} | {r['seconds']:.2f} | "
                     f"{r['tokens_per_second']:.0f} | {r.get('speed_vs_fp16', 1.0):.2f} | "
                     f"{r['peak_bytes'] / 1e9:.2f} | {r.get('peak_vs_fp16', 1.0):.2f} |")
    (args.out / "prefill.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for label in methods:
            pts = sorted((r["context"], r["tokens_per_second"], r["peak_bytes"]) for r in rows if r["method"] == label)
            a.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
            b.plot([p[0] for p in pts], [p[2] / 1e9 for p in pts], "o-", label=label)
        a.set(xscale="log", xlabel="context (tokens)", ylabel="prefill tokens/s", title="prefill speed")
        b.set(xscale="log", xlabel="context (tokens)", ylabel="peak GB above the model", title="prefill peak memory")
        a.legend()
        fig.tight_layout()
        fig.savefig(args.out / "prefill.png", dpi=110)
    except ImportError:
        print("no plot: matplotlib is not installed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
