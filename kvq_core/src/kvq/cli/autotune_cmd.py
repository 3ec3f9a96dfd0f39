"""``kvq autotune``: measure pure MLX against each kernel over a grid of sizes on this device, find each kernel's
crossover (the size from which it is faster), and store the table under the kvq cache dir, where kvq.select
uses it instead of the cost model ('kvq select' shows "measured crossover N (kvq autotune, FILE)").
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from .. import tuning
from ..bench import autotune, ops


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvq autotune``."""
    p = argparse.ArgumentParser(prog="kvq autotune", description=__doc__)
    p.add_argument("--methods", default=None,
                   help=f"comma-separated methods, kvq eval syntax (default: {','.join(ops.DEFAULT_METHODS)})")
    p.add_argument("--ops", default=None, help=f"comma-separated subset of {','.join(ops.OPS)} (default: all)")
    p.add_argument("--sizes", default=None, help="N vectors for quantize/dequantize (default: as kvq bench ops)")
    p.add_argument("--contexts", default=None, help="context lengths T for attend (default: as kvq bench ops)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per measurement (default 2)")
    p.add_argument("--reps", type=int, default=5, help="timed calls; the median is used (default 5)")
    p.add_argument("--from-bench", default=None, metavar="BENCH_OPS_JSON",
                   help="take the timings of a 'kvq bench ops' run on this device instead of measuring again")
    p.add_argument("--out-dir", default=None, help="also write a copy of the table here (e.g. benchmarks/results)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _summary(document: dict, paths: list[Path]) -> str:
    lines = [f"kvq autotune on {document['device']} ({document['device_kind']}), MLX {document['mlx']}, "
             f"kvq {document['kvq']}"]
    for e in document["entries"]:
        unit = "T" if e["op"] == "attend" else "N"
        lines.append(f"  {e['label']:<16}{e['op']:<11}{e['backend']:<8} kernel faster: {e['verdict']:<12}"
                     f"({unit} {e['sizes'][0]}..{e['sizes'][-1]}, {len(e['sizes'])} sizes)")
    if not document["entries"]:
        lines.append(f"  no kernel runs on this {document['device_kind']} device for these methods and ops: "
                     "selection keeps pure MLX / the cost model")
    lines.append("wrote " + ", ".join(map(str, paths)))
    return "\n".join(lines)


def _read_json(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--from-bench: cannot read {path} as JSON: {exc}") from None


def main(argv: list[str]) -> int:
    """Run ``kvq autotune``; arguments are checked before anything is measured."""
    args = parser().parse_args(argv)
    if args.warmup < 0 or args.reps < 1:
        raise ValueError(f"--warmup must be >= 0 and --reps >= 1; got {args.warmup} and {args.reps}")
    ops.parse_methods(args.methods)
    ops.parse_ops(args.ops)
    sizes = ops.parse_sizes(args.sizes, "--sizes") if args.sizes else None
    contexts = ops.parse_sizes(args.contexts, "--contexts") if args.contexts else None
    command = "kvq autotune " + shlex.join(argv)
    if args.from_bench:
        document = autotune.from_bench(_read_json(args.from_bench), command)
    else:
        document = autotune.measure(args.methods, args.ops, sizes, contexts, warmup=args.warmup, reps=args.reps,
                                    command=command, progress=not args.no_progress)
    paths = [tuning.save(document)]
    if args.out_dir:
        paths.append(tuning.save(document, Path(args.out_dir) / f"autotune_{paths[0].name}"))
    print(_summary(document, paths))
    return 0
