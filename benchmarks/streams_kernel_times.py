"""Time per call of the streams kernels (tensor cores and SIMT) against fp16 SDPA, same process (issue #21).

B 1, H_q 32, H_kv 8, D 128, one query token; per method the call a cache's bound decode step makes (the
compressed tokens, 4 sinks and a 128-token window in one launch, the method's finish in the merge). Two figures
per call, in microseconds: ``batched`` = wall time of ``--calls`` independent calls evaluated together, divided by
their number (close to GPU time when the GPU is the bottleneck), ``single`` = one call built and evaluated at a
time (adds graph building and synchronisation). Each figure is the median of ``--reps`` repetitions.

``--variants`` (JSON: label -> :data:`kvq_metal.streams.TUNING` overrides) times the tensor-core kernel with other
launch knobs in the same process, each beside the default, and reports each output's largest relative difference
from the default variant's (``rel_to_default``: a variant that computes something else shows at once).

    python benchmarks/streams_kernel_times.py --out times.json [--contexts 32768,131072] [--calls 40] \
        [--variants '{"qsh": {"qsh": true, "pf": false, "nt": 1}}']
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from knobs import tuned  # noqa: E402
from profile_streams import D, dense_tokens, encode, random_inputs  # noqa: E402  (the streams benchmarks' setup)

METHODS = (("qjl", {}, "affine", {"bits": 4}), ("turboquant_prod", {"bits": 4}, "turboquant_prod", {"bits": 4}),
           ("turboquant_prod", {"bits": 3}, "turboquant_prod", {"bits": 3}))


def _time(fn, calls: int, reps: int) -> dict:
    mx.eval(fn())
    batched, single = [], []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        batched.append((time.perf_counter() - t) / calls * 1e6)
        t = time.perf_counter()
        for _ in range(calls):
            mx.eval(fn())
        single.append((time.perf_counter() - t) / calls * 1e6)
    return {"batched_us": round(statistics.median(batched), 1), "single_us": round(statistics.median(single), 1)}


def main() -> None:
    import kvq_metal
    from kvq_metal import streams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="32768,131072", help="compressed tokens, comma-separated")
    ap.add_argument("--calls", type=int, default=40, help="calls evaluated together (the batched figure)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (each figure is their median)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--variants", default="{}", help="JSON: label -> kvq_metal.streams knob overrides (knobs.tuned) of the tensor-core kernel")
    args = ap.parse_args()
    variants = {"tc": {"tc": True}, "simt": {"tc": False},
                **{label: {"tc": True, **knobs} for label, knobs in json.loads(args.variants).items()}}
    backend = kvq_metal.gpu_backend()
    results = {"sources": kvq_metal.sources_hash(), "device": str(mx.default_device()), "calls": []}
    for T in (int(t) for t in args.contexts.split(",")):
        q, k, v, window = random_inputs(T)
        row = {"T": T, "method": "fp16_sdpa", **_time(lambda: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=D ** -0.5), args.calls, args.reps)}
        print(json.dumps(row), flush=True)
        results["calls"].append(row)
        for km, kp, vm, vp in METHODS:
            impl, keys, values, call = encode(km, kp, vm, vp, k, v, backend)
            prepare, finish = impl._matrices(keys, values, call)
            dense = dense_tokens(window)
            reference = None
            for name, knobs in variants.items():
                with tuned(streams=knobs):
                    step = streams.bind_streams(call, q, D ** -0.5, prepare, finish, backend, dense.sink_keys,
                                                dense.sink_values, dense.window_keys, dense.window_values)
                label = f"{km}:{kp.get('bits', '')}+{vm}:{vp.get('bits', '')}"
                out = step(q, dense.window_keys, dense.window_values).astype(mx.float32)
                reference = out if reference is None else reference
                rel = mx.max(mx.abs(out - reference)) / mx.maximum(mx.max(mx.abs(reference)), 1e-30)
                row = {"T": T, "method": label, "variant": name, "kernel": "tc" if step.tensor_cores else "simt",
                       "rel_to_default": float(rel),
                       **_time(lambda: step(q, dense.window_keys, dense.window_values), args.calls, args.reps)}
                print(json.dumps(row), flush=True)
                results["calls"].append(row)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
