"""The streams kernel's launches for a profiler (issue #21): B 1, H_q 32, H_kv 8, D 128, one query.

For each context length, one fp16 ``mx.fast.scaled_dot_product_attention`` call, then per method (qjl keys with
affine-4 values, turboquant_prod-4) one call of ``kvq_metal.streams.decode_attend_streams`` over the compressed
tokens and one with 4 sinks and a 128-token window in the same launch (as a cache's bound step runs it), each
evaluated on its own, so a profiler's kernel filter sees one call's launches together. Prints one label per call.

    ncu --clock-control none --set full -k regex:"decode_attend_streams|decode_merge_streams" -c 4 -o streams \\
        python benchmarks/profile_streams.py --contexts 131072

``--tuning '{"kt": 8}'`` overrides the streams kernel's knobs (:class:`kvq_metal.knobs.StreamsKnobs`, through
``benchmarks/knobs.py``). What to read in the report: achieved
occupancy, the warp stall reasons (long scoreboard: waiting on global loads; barrier; short scoreboard: shared
memory) and DRAM throughput, against the tensor-core kernel's report (``benchmarks/profile_attend.py``).
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from knobs import knobs_arg, tuned  # benchmarks/ (the script's folder is on sys.path)

B, HQ, HKV, D = 1, 32, 8, 128
METHODS = (("qjl", {}, "affine", {"bits": 4}), ("turboquant_prod", {"bits": 4}, "turboquant_prod", {"bits": 4}))


def random_inputs(T: int) -> tuple:
    """``(q, k, v, window)`` bfloat16, evaluated: one query ``[B, H_q, 1, D]``, keys and values ``[B, H_kv, T, D]``,
    and ``window`` ``[B, H_kv, 4 + 128, D]``, whose first 4 tokens the streams benchmarks use as sinks and the rest
    as the residual window (:func:`dense_tokens`)."""
    q = mx.random.normal((B, HQ, 1, D)).astype(mx.bfloat16)
    k = mx.random.normal((B, HKV, T, D)).astype(mx.bfloat16)
    v = mx.random.normal((B, HKV, T, D)).astype(mx.bfloat16)
    window = mx.random.normal((B, HKV, 4 + 128, D)).astype(mx.bfloat16)
    mx.eval(q, k, v, window)
    return q, k, v, window


def dense_tokens(window: mx.array):
    """:class:`kvq.attention.DenseTokens` of :func:`random_inputs`' ``window``: 4 sinks, then the window."""
    from kvq.attention import DenseTokens

    return DenseTokens(window[:, :, :4], window[:, :, :4], window[:, :, 4:], window[:, :, 4:])


def encode(km: str, kp: dict, vm: str, vp: dict, k: mx.array, v: mx.array, backend: str) -> tuple:
    """``(impl, keys, values, call)``: ``k`` and ``v`` ``[B, H_kv, T, D]`` encoded by pure MLX with the key and value
    methods and parameters (affine's groups fitted to ``D``), the key method's kernel implementation on
    ``backend`` and its :class:`kvq_metal.streams.StreamCall` of them (the setup the streams benchmarks share)."""
    import kvq
    from kvq.plugins import registry

    reg = registry()
    kparams, vparams = kvq.make_params(km, **kp), kvq.make_params(vm, **vp)
    if vm == "affine":
        vparams = vparams.for_head_dim(k.shape[-1])
    keys = reg.implementations[(km, "mlx")].kvq_quantize(k, kparams)
    values = reg.implementations[(vm, "mlx")].kvq_quantize(v, vparams)
    mx.eval(keys.data, values.data)
    impl = reg.implementations[(km, backend)]
    return impl, keys, values, impl.stream_call(keys, values)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="131072", help="comma-separated token counts")
    ap.add_argument("--tuning", default="{}", type=knobs_arg,
                    help="JSON overrides of kvq_metal.streams' knobs (kvq_metal.knobs.StreamsKnobs)")
    args = ap.parse_args()
    with tuned(streams=args.tuning):
        run(args.contexts)


def run(contexts: str) -> None:
    """The launches profiled: per context and method, the streams kernel without and with dense tokens."""
    import kvq_metal
    from kvq_metal import streams

    backend = kvq_metal.gpu_backend()
    for T in (int(t) for t in contexts.split(",")):
        q, k, v, window = random_inputs(T)
        print(json.dumps({"T": T, "method": "fp16_sdpa"}), flush=True)
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5))
        for km, kp, vm, vp in METHODS:
            impl, keys, values, call = encode(km, kp, vm, vp, k, v, backend)
            prepared = mx.random.normal((B, HKV, HQ // HKV, call.query_dim))
            mx.eval(prepared)
            dense = dense_tokens(window)
            _, finish = impl._matrices(keys, values, call)
            for label, kwargs in (("codes", {}), ("codes+dense", dict(dense=dense, raw_queries=q,
                                                                         scale=D ** -0.5, finish=finish))):
                for warm in (True, False):
                    print(json.dumps({"T": T, "method": f"{km}+{vm}", "call": label,
                                      **({"warmup": True} if warm else {})}), flush=True)
                    mx.eval(streams.decode_attend_streams(prepared, call, backend, **kwargs))


if __name__ == "__main__":
    main()
