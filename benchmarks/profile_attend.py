"""Decode-attention launches for a profiler: B 1 (``--batch``), H_q 32, H_kv 8, D 128, one query, keys and values
distinct.

For each context length: one fp16 ``mx.fast.scaled_dot_product_attention`` call, then one ``kvq_attend`` kernel
call per method (turboquant-4, turboquant-3, affine-4) and launch variant, and one call with 4 sinks and a
128-token window uncompressed (labelled ``"dense"``, as a KVQCache attends) and, per variant, the bound decode step
a KVQCache replays (labelled ``"bound"``), each evaluated on its own after its
inputs, so a profiler's kernel filter sees the launches of one call together. Prints one label per call, in order.

    ncu --clock-control none -k regex:"decode_attend|decode_merge|zero_counters|sdpa" \\
        python benchmarks/profile_attend.py --contexts 131072 [--variants variants.json]

``variants.json``: a list of ``kvq_metal.attend.TUNING`` overrides (default ``[{}]``), each run for every method.
``--batch B`` attends B sequences in each call (a server's batch, ``kvq bench capacity``): the first sequence's codes
are encoded once and repeated for the others (a kernel's time does not depend on the values it reads; encoding B
sequences of 32K tokens in pure MLX would not fit the device's memory).
:mod:`benchmarks.kernel_durations` runs this under ``ncu`` and records each call's GPU time.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from kvq.attention import DenseTokens

from knobs import tuned  # benchmarks/ (the script's folder is on sys.path)
from kv_encode import encode_kv

HQ, HKV, D = 32, 8, 128
METHODS = (("turboquant", {"bits": 4}), ("turboquant", {"bits": 3}), ("affine", {"bits": 4}))


def main() -> None:
    import kvq_metal
    from kvq_metal import attend

    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="131072", help="comma-separated token counts")
    ap.add_argument("--variants", default=None, help="JSON file: a list of kvq_metal.attend knob overrides (knobs.tuned)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per call (B), default 1")
    args = ap.parse_args()
    B = args.batch
    if B < 1:
        ap.error(f"--batch must be at least 1, got {B}")
    variants = json.load(open(args.variants)) if args.variants else [{}]
    backend = kvq_metal.gpu_backend()
    for T in (int(t) for t in args.contexts.split(",")):
        q = mx.random.normal((B, HQ, 1, D)).astype(mx.float16)
        k = mx.random.normal((B, HKV, T, D)).astype(mx.float16)
        v = mx.random.normal((B, HKV, T, D)).astype(mx.float16)
        mx.eval(q, k, v)
        for warm in (True, False):
            print(json.dumps({"T": T, "method": "fp16_sdpa", **({"warmup": True} if warm else {})}), flush=True)
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5))
        for name, params in METHODS:
            _, _, kern, ke, ve = encode_kv(name, params, k[:1], v[:1], backend)
            if B > 1:  # the first sequence's codes for every sequence
                ke, ve = (e.map(lambda a: mx.contiguous(mx.broadcast_to(a, (B, *a.shape[1:])))) for e in (ke, ve))
                mx.eval(ke.data, ve.data)
            # the first launch on fresh arrays ran up to twice as long on the H200: warm up, labelled, dropped
            print(json.dumps({"T": T, "method": f"{name}{params['bits']}", "warmup": True}), flush=True)
            mx.eval(kern.kvq_attend(q, ke, ve, D ** -0.5, None)[0])
            for variant in variants:
                with tuned(attend=variant):
                    print(json.dumps({"T": T, "method": f"{name}{params['bits']}", **variant}), flush=True)
                    mx.eval(kern.kvq_attend(q, ke, ve, D ** -0.5, None)[0])
            # as a KVQCache attends: the compressed tokens with 4 sinks and a 128-token window in one softmax (a
            # launch over the uncompressed tokens, then the compressed one, which merges both)
            dense = DenseTokens(*(mx.contiguous(x) for x in (k[:, :, :4], v[:, :, :4], k[:, :, -128:], v[:, :, -128:])))
            mx.eval(dense.sink_keys, dense.sink_values, dense.window_keys, dense.window_values)
            for warm in (True, False):
                print(json.dumps({"T": T, "method": f"{name}{params['bits']}", "dense": True,
                                  **({"warmup": True} if warm else {})}), flush=True)
                # unchecked, like kvq_attend above: a first-use check's launches would fall under this label
                mx.eval(kern._attend_dense(q, ke, ve, D ** -0.5, dense)[0])
            # the decode step a KVQCache replays (bound once: kvq_metal.step.DecodeStep, one launch per call, the
            # kernel text baked with the plan's values, launch bounds included), per variant; labelled "bound"
            for variant in variants:
                with tuned(attend=variant):
                    step = kern._bind_unchecked(q, ke, ve, D ** -0.5, dense.sink_keys, dense.sink_values,
                                                dense.window_keys, dense.window_values)
                for warm in (True, False):  # the warm-up call also runs the binding's counter launch
                    print(json.dumps({"T": T, "method": f"{name}{params['bits']}", "bound": True, **variant,
                                      **({"warmup": True} if warm else {})}), flush=True)
                    mx.eval(step(q, dense.window_keys, dense.window_values))
            del ke, ve


if __name__ == "__main__":
    main()
