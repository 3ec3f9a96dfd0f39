"""kvq_metal kernels vs pure MLX on this GPU: decode attention, fused TurboQuant encode, intermediate memory.

Decode attention: B = 1, H_q = 32, H_kv = 8, D = 128, one query (REFERENCE_VALUES.md), T = 4K..128K, timed as
isolated calls and as 16 calls evaluated together (the in-model cost, without per-call Python and sync), against
``mx.fast.scaled_dot_product_attention`` on fp16 and mlx-lm's quantized SDPA (affine 4-bit) in the same run;
achieved bandwidth on the compressed bytes vs the measured elementwise bandwidth. Encode: N vectors of head_dim
128. Writes JSON to argv[1].

    python benchmarks/kernels.py results.json
"""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import sys
import time

import mlx.core as mx

import kvq
from kvq.plugins import registry

from knobs import tuned  # benchmarks/ (the script's folder is on sys.path)
from kv_encode import encode_kv


def timeit(fn, warmup=3, reps=30) -> float:
    """Median milliseconds of ``fn`` (evaluated and synchronised each call)."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3


def timeit_batched(fn, calls=16, warmup=2, reps=10) -> float:
    """Median milliseconds per call when ``calls`` calls are built into one graph and evaluated together: the
    cost inside a model's decode step, where Python, graph building and launches overlap the GPU's work (an
    isolated call, :func:`timeit`, also pays them in full)."""
    for _ in range(warmup):
        mx.eval([fn(i) for i in range(calls)])
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval([fn(i) for i in range(calls)])
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3 / calls


def elementwise_bandwidth() -> float:
    """Bytes read + written per second by ``a * 2`` over 1 GiB of float16."""
    a = mx.ones((2**29,), mx.float16)
    mx.eval(a)
    ms = timeit(lambda: a * 2, reps=20)
    return 2 * a.nbytes / (ms / 1e3)


def overhead_rows(backend):
    """The fixed cost of one call: an empty custom kernel, a tiny MLX op, fp16 SDPA and the turboquant-4 kernel at
    256 tokens, each isolated and 16 evaluated together; and the Python time of building the kernel's graph."""
    from kvq_metal.dialect import kernel

    noop = kernel("noop", backend, ("a",), ("out",), "if (KVQ_GID == 0) out[0] = a[0];")
    a = mx.ones((4,), mx.float32)
    B, Hq, Hkv, D, T = 1, 32, 8, 128, 256
    q = mx.random.normal((B, Hq, 1, D)).astype(mx.float16)
    k = mx.random.normal((B, Hkv, T, D)).astype(mx.float16)
    p = kvq.make_params("turboquant", bits=4)
    pure = registry().implementations[("turboquant", "mlx")]
    kern = registry().implementations[("turboquant", backend)]
    ke = pure.kvq_quantize(k, p)
    mx.eval(a, q, k, ke.data)
    qs = [mx.random.normal((B, Hq, 1, D)).astype(mx.float16) for _ in range(16)]
    mx.eval(qs)
    calls = {
        "noop_kernel": (lambda: noop(inputs=[a], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)],
                                     output_dtypes=[mx.float32])[0],
                        lambda i: noop(inputs=[qs[i].reshape(-1)[:4].astype(mx.float32)], grid=(32, 1, 1),
                                       threadgroup=(32, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])[0]),
        "tiny_add": (lambda: a + 1, lambda i: qs[i] + 1),
        "fp16_sdpa_256": (lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=D ** -0.5),
                          lambda i: mx.fast.scaled_dot_product_attention(qs[i], k, k, scale=D ** -0.5)),
        "tq4_kernel_256": (lambda: kern.kvq_attend(q, ke, ke, D ** -0.5, None)[0],
                           lambda i: kern.kvq_attend(qs[i], ke, ke, D ** -0.5, None)[0]),
    }
    row = {}
    for name, (single, batched) in calls.items():
        row[f"{name}_ms"] = timeit(single, reps=50)
        row[f"{name}_batched_ms"] = timeit_batched(batched)
    tic = time.perf_counter()
    for _ in range(200):
        kern.kvq_attend(q, ke, ke, D ** -0.5, None)
    row["tq4_graph_build_python_ms"] = (time.perf_counter() - tic) / 200 * 1e3
    print(json.dumps(row), flush=True)
    return [row]


def decode_rows(backend):
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from kvq_metal import attend

    B, Hq, Hkv, D = 1, 32, 8, 128
    scale = D ** -0.5
    rows = []
    methods = [("affine", {"bits": 4}), ("turboquant", {"bits": 4}), ("turboquant", {"bits": 3}),
               ("turboquant", {"bits": 2}), ("turboquant_rvq", {"bits": 2, "residual_bits": 1}),
               ("turboquant_rvq", {"bits": 2, "residual_bits": 2})]
    for T in (4096, 16384, 65536, 131072):
        q = mx.random.normal((B, Hq, 1, D)).astype(mx.float16)
        k = mx.random.normal((B, Hkv, T, D)).astype(mx.float16)
        v = mx.random.normal((B, Hkv, T, D)).astype(mx.float16)
        mx.eval(q, k, v)
        qs = [mx.random.normal((B, Hq, 1, D)).astype(mx.float16) for _ in range(16)]
        mx.eval(qs)
        row = {"T": T, "fp16_sdpa_ms": timeit(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)),
               "fp16_sdpa_batched_ms": timeit_batched(
                   lambda i: mx.fast.scaled_dot_product_attention(qs[i], k, v, scale=scale)),
               "fp16_bytes": k.nbytes + v.nbytes}
        try:
            qk, qv = mx.quantize(k, 64, 4), mx.quantize(v, 64, 4)
            row["mlx_lm_affine4_ms"] = timeit(lambda: quantized_scaled_dot_product_attention(
                q, qk, qv, scale=scale, mask=None, group_size=64, bits=4))
        except Exception as exc:  # MLX 0.32 CUDA quantized_matmul lacks some shapes
            row["mlx_lm_affine4_error"] = f"{type(exc).__name__}: {exc}"
        for name, params in methods:
            p, pure, kern, ke, ve = encode_kv(name, params, k, v, backend)
            label = f"{name}{params['bits']}" + (f"{params['residual_bits']}" if "residual_bits" in params else "")
            row[f"{label}_bytes"] = ke.nbytes + ve.nbytes
            row[f"{label}_kernel_ms"] = timeit(lambda: kern.kvq_attend(q, ke, ve, scale, None)[0])
            row[f"{label}_kernel_batched_ms"] = timeit_batched(lambda i: kern.kvq_attend(qs[i], ke, ve, scale, None)[0])
            row[f"{label}_pure_ms"] = timeit(lambda: pure.kvq_attend(q, ke, ve, scale, None)[0], reps=5)
            plan = kvq.select(name, (B, Hkv, T, D), params=p, op="attend", num_q_heads=Hq)
            row[f"{label}_selected"] = plan.choices["attend"].backend
            row[f"{label}_kernel_GBps"] = row[f"{label}_bytes"] / row[f"{label}_kernel_ms"] / 1e6
            if backend == "cuda" and name in ("turboquant", "affine") and params["bits"] >= 3:
                # the SIMT kernel (the Metal design) on the same data, for the tensor-core kernel's gain
                with tuned(attend={"tc": False}):
                    row[f"{label}_simt_kernel_ms"] = timeit(lambda: kern.kvq_attend(q, ke, ve, scale, None)[0])
                    row[f"{label}_simt_kernel_batched_ms"] = timeit_batched(
                        lambda i: kern.kvq_attend(qs[i], ke, ve, scale, None)[0])
            del ke, ve
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def sweep_rows(backend):
    """Launch-shape sweep of the decode-attention kernels (kvq_metal.knobs.AttendKnobs through knobs.tuned,
    TARGET_GROUPS) at 128K
    tokens, isolated and 16 calls evaluated together: the tensor-core kernel's table copies per lane (``rep``), pair
    tables, sub-tiles per warp step (``nt``) and thread groups, and the SIMT kernel (``tc`` False) beside it; fp16
    SDPA in the same run."""
    from kvq_metal import attend

    B, Hq, Hkv, D = 1, 32, 8, 128
    base_groups = dict(attend.TARGET_GROUPS)
    configs = [{}, {"rep": False}, {"pair": False}, {"nt": 1}, {"tc_groups": 396}, {"tc_groups": 528},
               {"nt": 1, "tc_groups": 528}, {"pf": True}, {"tc": False}]
    rows = []
    for T in (131072,):
        q = mx.random.normal((B, Hq, 1, D)).astype(mx.float16)
        qs = [mx.random.normal((B, Hq, 1, D)).astype(mx.float16) for _ in range(16)]
        k = mx.random.normal((B, Hkv, T, D)).astype(mx.float16)
        mx.eval(q, qs, k)
        rows.append({"T": T, "method": "fp16_sdpa",
                     "ms": timeit(lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=D ** -0.5)),
                     "batched_ms": timeit_batched(
                         lambda i: mx.fast.scaled_dot_product_attention(qs[i], k, k, scale=D ** -0.5))})
        print(json.dumps(rows[-1]), flush=True)
        for name, params in (("turboquant", {"bits": 4}), ("turboquant", {"bits": 3}), ("affine", {"bits": 4})):
            p = kvq.make_params(name, **params)
            pure = registry().implementations[(name, "mlx")]
            kern = registry().implementations[(name, backend)]
            ke = pure.kvq_quantize(k, p)
            mx.eval(ke.data)
            for cfg in configs:
                attend.TARGET_GROUPS[backend] = cfg.get("groups", base_groups[backend])
                try:
                    with tuned(attend={k_: v for k_, v in cfg.items() if k_ != "groups"}):
                        ms = timeit(lambda: kern.attend_kernel(q, ke, ke, D ** -0.5)[0])
                        batched = timeit_batched(lambda i: kern.attend_kernel(qs[i], ke, ke, D ** -0.5)[0])
                    rows.append({"T": T, "method": f"{name}{params['bits']}", **cfg, "ms": ms, "batched_ms": batched})
                except Exception as exc:
                    rows.append({"T": T, "method": f"{name}{params['bits']}", **cfg, "error": str(exc)[:500]})
                finally:
                    attend.TARGET_GROUPS.update(base_groups)
                print(json.dumps(rows[-1]), flush=True)
            del ke
    return rows


def quantize_rows(backend):
    rows = []
    D = 128
    for bits in (4, 3):
        p = kvq.make_params("turboquant", bits=bits)
        pure = registry().implementations[("turboquant", "mlx")]
        kern = registry().implementations[("turboquant", backend)]
        for n in (2**12, 2**16, 2**18, 2**20, 2**21):
            x = mx.random.normal((1, 8, n // 8, D)).astype(mx.float16)
            mx.eval(x)
            row = {"bits": bits, "N": n, "kernel_ms": timeit(lambda: kern.kvq_quantize(x, p).data["codes"]),
                   "pure_ms": timeit(lambda: pure.kvq_quantize(x, p).data["codes"], reps=5)}
            row["speedup"] = row["pure_ms"] / row["kernel_ms"]
            enc = pure.kvq_quantize(x, p)
            mx.eval(enc.data)
            row["dequant_kernel_ms"] = timeit(lambda: kern.kvq_dequantize(enc, mx.float16))
            row["dequant_pure_ms"] = timeit(lambda: pure.kvq_dequantize(enc, mx.float16), reps=5)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del x, enc
    return rows


def memory_rows(backend):
    rows = []
    p = kvq.make_params("turboquant", bits=4)
    x = mx.random.normal((1, 8, 4096, 256)).astype(mx.float16)
    mx.eval(x)
    for name in ("mlx", backend):
        impl = registry().implementations[("turboquant", name)]
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        enc = impl.kvq_quantize(x, p)
        mx.eval(enc.data)
        rows.append({"impl": name, "shape": list(x.shape),
                     "intermediate_MB": (mx.get_peak_memory() - base - enc.nbytes) / 2**20})
        print(json.dumps(rows[-1]), flush=True)
        del enc
    return rows


def main(out_path):
    import kvq_metal

    backend = kvq_metal.gpu_backend()
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    meta = {"device": str(info.get("device_name", mx.default_device())), "backend": backend, "mlx": mx.__version__,
            "kvq": kvq.__version__, "kernel_sources_sha256_16": kvq_metal.sources_hash(), "commit": commit,
            "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv)}
    meta["elementwise_GBps"] = elementwise_bandwidth() / 1e9
    print(json.dumps(meta), flush=True)
    sweep = sweep_rows(backend) if "--sweep" in sys.argv else None
    if "--sweep-only" in sys.argv:
        result = {"meta": meta, "sweep": sweep_rows(backend)}
    else:
        result = {"meta": meta, "overhead": overhead_rows(backend), "memory": memory_rows(backend),
                  "decode": decode_rows(backend),
                  "quantize": quantize_rows(backend), "sweep": sweep}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1])  # options: --sweep (add the launch-shape sweep), --sweep-only
