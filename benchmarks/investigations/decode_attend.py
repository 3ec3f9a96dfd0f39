"""Decode attention (one query) over T cached tokens: fp16 SDPA, mlx-lm affine quantized SDPA, kvq attends.

Shape from ../shared/REFERENCE_VALUES.md: B = 1, H_q = 32, H_kv = 8, D = 128. Writes JSON to argv[1].
Pure-MLX kvq implementations (no fused kernels yet): this is the baseline the kernels must beat.
"""

import json
import sys
import time

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention

import kvq


def timeit(fn, warmup=3, reps=20):
    for _ in range(warmup):
        mx.eval(fn())
    tic = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - tic) / reps * 1e3


def main(out_path):
    B, Hq, Hkv, D = 1, 32, 8, 128
    rows = []
    for T in (4096, 16384, 65536, 131072):
        q = mx.random.normal((B, Hq, 1, D)).astype(mx.float16)
        k = mx.random.normal((B, Hkv, T, D)).astype(mx.float16)
        v = mx.random.normal((B, Hkv, T, D)).astype(mx.float16)
        mx.eval(q, k, v)
        row = {"T": T, "fp16_sdpa_ms": timeit(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5))}
        qk, qv = mx.quantize(k, 64, 4), mx.quantize(v, 64, 4)
        row["mlx_lm_affine4_ms"] = timeit(lambda: quantized_scaled_dot_product_attention(
            q, qk, qv, scale=D**-0.5, mask=None, group_size=64, bits=4))
        for name, params in (("affine", {"bits": 4}), ("turboquant", {"bits": 3}), ("turboquant", {"bits": 4})):
            p = kvq.make_params(name, **params)
            plan = kvq.select(name, (B, Hkv, T, D), params=p, num_q_heads=Hq)
            ke, ve = plan.quantize(k, p), plan.quantize(v, p)
            mx.eval(ke.data, ve.data)
            label = f"kvq_{name}{params['bits']}"
            row[label + "_ms"] = timeit(lambda: plan.attend(q, ke, ve, D**-0.5, None)[0])
            row[label + "_bytes"] = ke.nbytes + ve.nbytes
            del ke, ve
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = {"device": str(mx.default_device()), "mlx": mx.__version__, "shape": [B, Hq, Hkv, D]}
    with open(out_path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1])
