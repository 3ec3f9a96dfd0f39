"""GPU time of each decode-attention call (all its kernel launches), fp16 SDPA beside it, read by Nsight Compute.

Wall-clock timing of one call (``benchmarks/kernels.py``) includes Python, graph building, launch and
synchronisation, about 0.15 ms on MLX's CUDA back end, which hides the kernels' own difference; calls evaluated
together may overlap on the GPU. Here ``ncu`` measures ``gpu__time_duration`` of every launch of
``benchmarks/profile_attend.py`` and each call's launches are summed. Writes JSON to ``--out``.

    python benchmarks/kernel_durations.py --out durations.json [--contexts 4096,131072] [--variants v.json] \
        [--batch 122]
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
FILTER = "regex:decode_attend|decode_merge|zero_counters|sdpa|fmha|flash"


#: Achieved occupancy: active warps per SM as a percentage of the most an SM holds (64 on an H200).
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"
#: Multipliers to microseconds of the time units ncu prints.
UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def launch_marker(name: str):
    """A function that launches a one-thread CUDA kernel named ``name`` and waits for it: a boundary in the launch
    list ncu records (``benchmarks/investigations/decode_step_kernels.py``, ``chunk_kernels.py``). Every marker reads
    one input, made and evaluated at the first marker's making, so no fill kernel of it joins the work between two
    markers."""
    import mlx.core as mx

    kern = mx.fast.cuda_kernel(name=name, input_names=["x"], output_names=["y"], source="y[0] = x[0];")
    x = _marker_input()

    def mark() -> None:
        mx.eval(kern(inputs=[x], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                     output_dtypes=[mx.float32])[0])
    return mark


@functools.cache
def _marker_input():
    import mlx.core as mx

    x = mx.zeros((1,), mx.float32)
    mx.eval(x)
    return x


def parse_ncu_csv(text: str) -> list[dict]:
    """Launches in order from ``ncu --csv`` output (one row per launch and metric): ``{"kernel": name, metric:
    value}``, times in microseconds, counts as numbers (ncu's thousands separators removed)."""
    rows = list(csv.reader(io.StringIO(text)))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    h = rows[head]
    launches: dict[str, dict] = {}
    for r in rows[head + 1:]:
        if len(r) != len(h):
            continue
        d = launches.setdefault(r[h.index("ID")], {"kernel": r[h.index("Kernel Name")]})
        value = float(r[h.index("Metric Value")].replace(",", ""))
        d[r[h.index("Metric Name")]] = value * UNITS.get(r[h.index("Metric Unit")], 1.0)
    return [launches[k] for k in sorted(launches, key=int)]


def group_calls(labels: list[dict], launches: list[dict]) -> list[dict]:
    """Each labelled call (``profile_attend.py``'s lines, in order) with its launches and their summed GPU time:
    fp16 SDPA is one launch; a kvq call runs up to its tensor-core attention kernel (after the counters' launch;
    a call labelled ``"dense"`` attends the uncompressed tokens in the same launch) or, for the SIMT kernel, up to
    its merge kernel. Warm-up calls are dropped.

    :raises ValueError: fewer launches than the labels need.
    """
    results, i = [], 0
    for label in labels:
        ours = label["method"] != "fp16_sdpa"
        parts, attends = [], 1
        while i < len(launches):
            parts.append(launches[i])
            i += 1
            name = parts[-1]["kernel"]
            attends -= "decode_attend_tc" in name
            if not ours or "decode_merge" in name or attends == 0:
                break
        if not parts:
            raise ValueError(f"no launch left for {label}")
        results.append({**label, "gpu_us": sum(p["gpu__time_duration.sum"] for p in parts),
                        "launches": [{"kernel": p["kernel"].split("(")[0][-90:],
                                      "us": p["gpu__time_duration.sum"],
                                      "registers": p.get("launch__registers_per_thread"),
                                      "blocks": p.get("launch__grid_size"),
                                      "occupancy_limit_registers": p.get("launch__occupancy_limit_registers"),
                                      "achieved_occupancy_pct": p.get(OCCUPANCY)} for p in parts]})
    return [r for r in results if not r.get("warmup")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", default="4096,16384,65536,131072")
    ap.add_argument("--variants", default=None)
    ap.add_argument("--batch", type=int, default=1, help="sequences per call, as profile_attend.py --batch")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    args = ap.parse_args()
    cmd = [sys.executable, str(HERE / "profile_attend.py"), "--contexts", args.contexts, "--batch", str(args.batch)]
    if args.variants:
        cmd += ["--variants", args.variants]
    log = Path(args.out).with_suffix(".ncu.csv")
    run = subprocess.run([args.ncu, "--clock-control", "none", "-k", FILTER, "--metrics",
                          "gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,"
                          f"launch__occupancy_limit_registers,{OCCUPANCY}", "--csv",
                          "--log-file", str(log), *cmd], capture_output=True, text=True)
    labels = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode or not labels:
        raise SystemExit(f"ncu failed ({run.returncode}): {run.stderr[-3000:]}")
    results = group_calls(labels, parse_ncu_csv(log.read_text()))
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "launches"}), flush=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": results}, indent=1))


if __name__ == "__main__":
    main()
