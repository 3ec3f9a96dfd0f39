"""The GPU kernels one prefill chunk launches per layer, and their GPU time, read by Nsight Compute (issue #51: where
the update's and the attention's device time goes).

For each method, one layer's cache is filled to ``--context`` tokens, then ``--reps`` chunks of ``--chunk`` tokens
are stored (``update_and_fetch``, evaluated) and attended (``attend``, evaluated) on copies of the filled cache,
as ``benchmarks/prefill_parts.py`` does. A named one-thread kernel launched between the parts marks them in the
launch list, so every launch ncu records falls in its part; the per-part, per-kernel GPU microseconds (mean over
repetitions) are printed and written as JSON. ``kvcache`` (mlx-lm's KVCache with MLX's causal attention) is the
reference. CUDA only (``mx.fast.cuda_kernel``).

    python benchmarks/investigations/chunk_kernels.py OUT_DIR [--contexts 8K] [--methods kvcache,turboquant:3]
        (and prefill_parts.py's layer options)
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the layer setup prefill_parts.py times
from kernel_durations import launch_marker, parse_ncu_csv  # noqa: E402
from prefill_parts import _size, filled_copies, layer_inputs, layer_parser, layer_source  # noqa: E402


def marker(label: str) -> None:
    """Launch a one-thread kernel named after ``label`` (letters and digits) and wait: the parts' boundary."""
    launch_marker(f"marker_{label}")()


def child(args) -> None:
    """Run the parts (under ncu): fill, then per method ``reps`` of update and attend between markers."""
    import mlx.core as mx

    from kvq.bench.fill import cache_arrays, fill
    from kvq.evaluation.spec import make_layer_cache, parse_method

    _, source = layer_source(args)
    scale = args.head_dim ** -0.5
    for context in [_size(c) for c in args.contexts.split(",")]:
        q, k_new, v_new, k_all, v_all = layer_inputs(args, source, context)
        for method in [m.strip() for m in args.methods.split(",")]:
            tag = f"{method.replace(':', '').replace('_', '')}x{context}"
            if method == "kvcache":
                from mlx_lm.models.cache import KVCache

                def filled():
                    c = KVCache()
                    c.update_and_fetch(k_all[:, :, :context], v_all[:, :, :context])
                    mx.eval(c.keys, c.values)
                    return c

                copies = [filled() for _ in range(args.reps + 1)]
                for i in range(args.reps + 1):
                    c = copies.pop()
                    marker(f"update{tag}r{i}")
                    kv = c.update_and_fetch(k_new, v_new)
                    mx.eval(kv)
                    marker(f"attend{tag}r{i}")
                    mx.eval(mx.fast.scaled_dot_product_attention(q, kv[0], kv[1], scale=scale, mask="causal"))
            else:
                cache = make_layer_cache(parse_method(method), sinks=4, window=128)
                fill([cache], source, context, args.chunk)
                copies = filled_copies(cache, args.reps + 1)
                for i in range(args.reps + 1):  # the first is a warm-up (kernels compile)
                    c = copies.pop()
                    marker(f"update{tag}r{i}")
                    c.update_and_fetch(k_new, v_new)
                    mx.eval(cache_arrays(c))
                    marker(f"attend{tag}r{i}")
                    mx.eval(c.attend(q, scale))
            marker("end")


def summarise(launches: list[dict]) -> list[dict]:
    """Rows of (part, method tag, kernel, launches per repetition, mean GPU us per repetition) from the launch list,
    warm-up repetitions (r0) dropped."""
    acc: dict = collections.defaultdict(lambda: [0, 0.0])
    reps: dict = collections.defaultdict(set)
    part = None
    for launch in launches:
        name = launch["kernel"].split("(")[0]
        if "marker_" in name:
            label = name.split("marker_")[1].split("_")[0]
            part = None if label == "end" or label.endswith("r0") else label
            if part:
                base, rep = part.rsplit("r", 1)
                reps[base].add(rep)
            continue
        if part:
            base = part.rsplit("r", 1)[0]
            key = (base, name[-80:])
            acc[key][0] += 1
            acc[key][1] += launch["gpu__time_duration.sum"]
    rows = []
    for (base, kernel), (n, us) in acc.items():
        r = len(reps[base])
        rows.append({"part": base, "kernel": kernel, "launches": n / r, "gpu_us": us / r})
    return rows


def main(argv=None) -> int:
    ap = layer_parser(__doc__, "8K")
    ap.add_argument("--methods", default="kvcache,turboquant:3,turboquant:4,affine:4")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "chunk_kernels.ncu.csv"
    cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--child"]
    run = subprocess.run([args.ncu, "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv",
                          "--log-file", str(log), *cmd], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"ncu failed ({run.returncode}): {run.stderr[-3000:]}")
    rows = summarise(parse_ncu_csv(log.read_text()))
    totals = collections.defaultdict(float)
    for r in rows:
        totals[r["part"]] += r["gpu_us"]
        print(f"{r['part']:32s} {r['launches']:5.1f} x {r['gpu_us']:9.1f} us  {r['kernel']}", flush=True)
    for part, us in totals.items():
        print(f"TOTAL {part:32s} {us:9.1f} us")
    (args.out / "chunk_kernels.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows,
                                                             "totals_us": totals}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
