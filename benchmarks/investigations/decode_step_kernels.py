"""Every GPU kernel of whole decode steps, read by Nsight Compute: what a step costs on the device, by kernel, and
what a window-flush step adds.

Builds a random-weight model (``--model random:PRESET``, ``--layers`` kept), fills each method's caches to
``--context`` tokens with random keys and values (``--batch`` sequences), runs ``--steps`` greedy decode steps one
at a time, and between steps launches a one-thread marker kernel (``kvq_step_marker``) so that ncu's launch list
splits into steps. Run under ncu (``--ncu``): the script re-runs itself there, then groups the launches per method
and step and writes ``--out`` (JSON): per step, whether the window flushed (compressed tokens grew), the summed GPU
time and each kernel's name and microseconds.

    python benchmarks/investigations/decode_step_kernels.py --out steps.json --context 32768 --layers 2 \
        --methods fp16,turboquant:4 --steps 36
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parents[1]  # benchmarks/, for kernel_durations
sys.path.insert(0, str(HERE))

MARKER = "kvq_step_marker"


def _marker():
    import mlx.core as mx

    if mx.default_device() == mx.cpu:  # a local smoke run: no markers
        return lambda: None
    from kernel_durations import launch_marker

    return launch_marker(MARKER)


def run_steps(args) -> list[dict]:
    """The measured program (under ncu): for each method, fill, then ``steps`` steps separated by markers; returns
    per method the flags of which steps flushed."""
    import mlx.core as mx

    from kvq.bench import e2e, random_model
    from kvq.bench.fill import RandomKV, fill

    config = random_model.random_config(args.model, args.layers)
    model = random_model.build_random_model(config, mx.bfloat16)
    settings = e2e.E2ESettings(contexts=(args.context,), flush=args.flush)
    mark = _marker()
    log = []
    for spec in e2e.parse_methods(args.methods):
        caches = e2e.make_cache(model, spec, settings)
        source = RandomKV(config["num_key_value_heads"], config["hidden_size"] // config["num_attention_heads"],
                          mx.bfloat16, batch=args.batch)
        fill(caches, source, args.context, 4096)
        y = mx.array([[1]] * args.batch)
        for _ in range(args.warmup):
            y = mx.argmax(model(y, cache=caches)[:, -1:, :], axis=-1)
            mx.eval(y)
        flushed = []
        mark()
        for _ in range(args.steps):
            before = getattr(caches[0], "compressed_keys", None)
            n0 = None if before is None else before.length
            y = mx.argmax(model(y, cache=caches)[:, -1:, :], axis=-1)
            mx.eval(y)
            flushed.append(n0 is not None and caches[0].compressed_keys.length != n0)
            mark()
        log.append({"method": spec.label, "flushed": flushed})
        del caches
        mx.clear_cache()
    return log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--methods", default="fp16,turboquant:4")
    ap.add_argument("--steps", type=int, default=36)
    ap.add_argument("--warmup", type=int, default=34)
    ap.add_argument("--flush", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (the capacity shape: many)")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        Path(args.out).with_suffix(".steps.json").write_text(json.dumps(run_steps(args)))
        return
    from kernel_durations import parse_ncu_csv

    csv_path = Path(args.out).with_suffix(".ncu.csv")
    cmd = [args.ncu, "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv",
           "--log-file", str(csv_path), sys.executable, __file__, "--inner", *sys.argv[1:]]
    run = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if run.returncode:
        raise SystemExit(f"ncu failed ({run.returncode}): {run.stderr[-3000:]} {run.stdout[-2000:]}")
    launches = parse_ncu_csv(csv_path.read_text())
    log = json.loads(Path(args.out).with_suffix(".steps.json").read_text())
    # split at markers: for each method, one marker before its steps and one after each step
    segments, current = [], []
    for launch in launches:
        if MARKER in launch["kernel"]:
            segments.append(current)
            current = []
        else:
            current.append(launch)
    results, i = [], 0
    for entry in log:
        i += 1  # the segment before this method's first marker: fill and warm-up
        steps = []
        for flushed in entry["flushed"]:
            seg = segments[i]
            i += 1
            steps.append({"flushed": flushed, "us": round(sum(k["gpu__time_duration.sum"] for k in seg), 2),
                          "kernels": [(k["kernel"][:80], round(k["gpu__time_duration.sum"], 2)) for k in seg]})
        results.append({"method": entry["method"], "steps": steps})
    Path(args.out).write_text(json.dumps({"context": args.context, "layers": args.layers, "batch": args.batch,
                                          "results": results}, indent=1))
    for r in results:
        normal = [s["us"] for s in r["steps"] if not s["flushed"]]
        flush = [s["us"] for s in r["steps"] if s["flushed"]]
        print(r["method"], "normal step us", sorted(normal)[len(normal) // 2] if normal else None,
              "launches", len(r["steps"][0]["kernels"]), "flush steps us", flush)


if __name__ == "__main__":
    main()
