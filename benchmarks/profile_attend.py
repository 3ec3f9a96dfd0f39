"""One call of each decode-attention kernel at T = 128K (B 1, H_q 32, H_kv 8, D 128) and of fp16 SDPA, for a
profiler (Nsight Compute) to capture:

    ncu --clock-control none -k regex:"decode_attend|decode_merge|zero_counters|sdpa" python benchmarks/profile_attend.py

Each kernel runs exactly once after its inputs are evaluated, so a profiler's kernel filter sees one launch per
method. Set KVQ_ATTEND_TUNING to profile other launch knobs.
"""

from __future__ import annotations

import sys

import mlx.core as mx

import kvq
from kvq.plugins import registry

B, HQ, HKV, D = 1, 32, 8, 128


def main(T: int = 131072) -> None:
    import kvq_metal

    backend = kvq_metal.gpu_backend()
    q = mx.random.normal((B, HQ, 1, D)).astype(mx.float16)
    k = mx.random.normal((B, HKV, T, D)).astype(mx.float16)
    v = mx.random.normal((B, HKV, T, D)).astype(mx.float16)
    mx.eval(q, k, v)
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5))
    for name, params in (("turboquant", {"bits": 4}), ("turboquant", {"bits": 3}), ("affine", {"bits": 4})):
        p = kvq.make_params(name, **params)
        pure = registry().implementations[(name, "mlx")]
        kern = registry().implementations[(name, backend)]
        ke, ve = pure.kvq_quantize(k, p), pure.kvq_quantize(v, p)
        mx.eval(ke.data, ve.data)
        mx.eval(kern.kvq_attend(q, ke, ve, D ** -0.5, None)[0])
        print(name, params, "done", flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
