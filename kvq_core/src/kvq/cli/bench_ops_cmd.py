"""``kvq bench ops``: each op of each method, every implementation that runs here (kernels and pure MLX), timed
over N vectors (quantize, dequantize) or context length T (decode attend, with fp16 SDPA as the reference line);
intermediate memory per call, achieved bandwidth of attend against the device's measured elementwise bandwidth.
Writes bench_ops.json and one PNG per op (log-log time against size) to --out; the PNGs need matplotlib
(the plots extra of kvq-core; the error says how to install it here; or pass --no-plot).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from ..bench import measure, ops, output, plot
from ..problem import device_kind

EPILOG = """
--methods takes kvq eval's method strings, one method for keys and values: NAME[:BITS][[NAME=VALUE,...]],
e.g. affine:4,turboquant:3,turboquant:4[rotation=qr]. Sizes take K, M, G suffixes (powers of 1024).
Defaults: on a GPU --sizes 1K,4K,...,4M and --contexts 1K,4K,16K,64K,128K; on the CPU 1K,4K,16K and 1K,4K.
"""


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvq bench ops``."""
    p = argparse.ArgumentParser(prog="kvq bench ops", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=None,
                   help=f"comma-separated methods (default: {','.join(ops.DEFAULT_METHODS)}, those installed)")
    p.add_argument("--ops", default=None, help=f"comma-separated subset of {','.join(ops.OPS)} (default: all)")
    p.add_argument("--sizes", default=None, help="N vectors for quantize/dequantize, e.g. 1K,64K,1M")
    p.add_argument("--contexts", default=None, help="context lengths T for attend, e.g. 4K,16K,64K,128K")
    p.add_argument("--head-dim", type=int, default=128, help="head_dim D (default 128)")
    p.add_argument("--dtype", choices=sorted(ops.DTYPES), default=None,
                   help="dtype of the vectors, queries and fp16 SDPA's keys and values (default float16 on a GPU, "
                        "float32 on the CPU, whose 16-bit attention is several times slower than its float32)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (default 3)")
    p.add_argument("--reps", type=int, default=10, help="timed calls; the median is reported (default 10)")
    p.add_argument("--bandwidth-bytes", default=None,
                   help="array size of the elementwise-bandwidth probe (default 1G on a GPU, 64M on the CPU)")
    p.add_argument("--out", default="bench-ops", help="output folder (default ./bench-ops)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true", help="write no PNG (matplotlib is not needed then)")
    return p


def settings_from(args: argparse.Namespace) -> ops.Settings:
    """Validated :class:`kvq.bench.ops.Settings` from parsed arguments (before any measurement).

    :raises ValueError: a bad ``--methods``, ``--ops``, ``--sizes``, ``--contexts``, ``--head-dim``,
        ``--warmup`` or ``--reps`` (the message names the option and what it allows).
    """
    if args.head_dim < 1:
        raise ValueError(f"--head-dim must be a positive integer; got {args.head_dim}")
    if args.warmup < 0 or args.reps < 1:
        raise ValueError(f"--warmup must be >= 0 and --reps >= 1; got {args.warmup} and {args.reps}")
    sizes, contexts = ops.default_sizes(device_kind())
    return ops.Settings(
        methods=ops.parse_methods(args.methods, args.head_dim), ops=ops.parse_ops(args.ops),
        sizes=ops.parse_sizes(args.sizes, "--sizes") if args.sizes else sizes,
        contexts=ops.parse_sizes(args.contexts, "--contexts") if args.contexts else contexts,
        head_dim=args.head_dim, dtype=ops.DTYPES[args.dtype or default_dtype()], warmup=args.warmup, reps=args.reps)


def default_dtype() -> str:
    """``--dtype``'s default: float32 on the CPU (MLX's 16-bit attention there is several times slower than its
    float32, so the fp16 SDPA reference line looked slower than kvq's attention: 89 ms against 22.5 ms at 4K, where
    in float32 it is 13.8 ms), float16 on a GPU."""
    return "float32" if device_kind() == "cpu" else "float16"


def describe(settings: ops.Settings) -> dict:
    """JSON-ready form of the settings."""
    return {"methods": [m.label for m in settings.methods], "params": {m.label: repr(m.params) for m in
            settings.methods}, "ops": list(settings.ops), "sizes": list(settings.sizes),
            "contexts": list(settings.contexts), "head_dim": settings.head_dim,
            "dtype": str(settings.dtype).removeprefix("mlx.core."), "warmup": settings.warmup, "reps": settings.reps,
            "attend_shape": {"B": ops.ATTEND_BATCH, "H_q": ops.ATTEND_Q_HEADS, "H_kv": ops.ATTEND_KV_HEADS,
                             "T_q": 1}}


def _summary(rows: list[dict]) -> str:
    lines = [f"{'method':<16}{'op':<11}{'impl':<14}{'size':>9}{'median ms':>11}{'interm. MiB':>12}{'GB/s':>8}"]
    for r in rows:
        bw = f"{r['bandwidth_Bps'] / 1e9:8.3g}" if "bandwidth_Bps" in r else ""
        lines.append(f"{r['method']:<16}{r['op']:<11}{r['implementation']:<14}{r['size']:>9}"
                     f"{r['median_s'] * 1e3:>11.4g}{r['intermediate_bytes'] / 2**20:>12.1f}{bw}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Run ``kvq bench ops``; every argument (and matplotlib, for the plots) is checked before anything is
    measured."""
    args = parser().parse_args(argv)
    settings = settings_from(args)
    if not args.no_plot:
        output.pyplot()  # fail now, not after the measurements, when matplotlib is missing
    probe = ops.parse_sizes(args.bandwidth_bytes, "--bandwidth-bytes")[0] if args.bandwidth_bytes else \
        (2**26 if device_kind() == "cpu" else 2**30)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = measure.environment("kvq bench ops " + shlex.join(argv))
    bandwidth = measure.elementwise_bandwidth(probe)
    document = {"benchmark": "kvq bench ops", "environment": env, "settings": describe(settings),
                "elementwise_bandwidth": bandwidth, "complete": False}

    def write(result: dict, **extra) -> None:
        ops.add_bandwidth(result["rows"], bandwidth["bandwidth_Bps"])
        document.update(result, **extra)
        output.write_json(document, out / "bench_ops.json")

    result = ops.run(settings, progress=not args.no_progress, on_step=write)
    plots = [] if args.no_plot else plot.plot_ops(result["rows"], out, env["device"])
    write(result, complete=True, plots=[Path(p).name for p in plots])
    print(_summary(result["rows"]))
    print(f"\n{document['settings']['dtype']}; elementwise bandwidth {bandwidth['bandwidth_Bps'] / 1e9:.0f} GB/s; "
          f"{env['device']}, MLX {env['mlx']}")
    print(f"wrote {out / 'bench_ops.json'}" + "".join(f", {p}" for p in plots))
    return 0
