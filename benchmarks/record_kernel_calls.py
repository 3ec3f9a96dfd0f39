"""Record every GPU kernel call kvq's kernel implementations make, on a machine without a GPU.

A refactor of the kernel code must not change what reaches the GPU. This script stubs MLX's custom-kernel
builders (``mx.fast.cuda_kernel``, ``mx.fast.metal_kernel``) with recorders that return zero-filled outputs,
pretends the default device is that GPU, passes every first-use check, and drives every registered kernel
implementation through its ops (quantize, dequantize, attend, attend with sinks and window, and the bound decode
steps a cache replays: ``bind_dense`` with and without sinks and ``bind_ragged_dense``, each called for three
steps with a growing window) over a fixed set of problems, the code-stream methods (``qjl`` keys with affine
values, ``turboquant_prod``, ``vecinfer`` calibrated on synthetic tokens under a temporary ``KVQ_DATA_DIR``)
among them. For each call it records the kernel's name (which holds a hash of its translated source), its inputs'
shapes and dtypes, its template arguments, grid, thread group and output shapes and dtypes, and the SHA-256 of
every kernel source built (and the source itself). Two runs (before and after a change) are compared with
``--compare``:

    python benchmarks/record_kernel_calls.py before.json
    python benchmarks/record_kernel_calls.py after.json --compare before.json

The verdict is one of: identical (same kernel names, so byte-identical sources, and the same calls); identical up
to kernel names, where every renamed kernel's source preprocesses (``clang++ -E -P``, whitespace normalised) to the
same token stream as before (a refactor that moved text into macros or include files); or different (exit 1).

Runs on the CPU (CI); implementations are found through kvq's registry, so the script does not depend on which
module holds them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import os
import subprocess
import sys
import tempfile
import warnings

import mlx.core as mx

CALLS: list[dict] = []
BUILT: dict[str, dict] = {}


class _Recorder:
    """Stands in for an MLX custom kernel object: records each call and returns zero-filled outputs."""

    def __init__(self, backend: str, **spec):
        self.backend, self.spec = backend, spec
        BUILT[spec["name"]] = {"backend": backend, "inputs": list(spec["input_names"]),
                               "outputs": list(spec["output_names"]),
                               "source_sha": hashlib.sha256((spec.get("header", "") + spec["source"]).encode())
                               .hexdigest()[:16],
                               "ensure_row_contiguous": spec.get("ensure_row_contiguous", True),
                               "text": spec.get("header", "") + "\n" + spec["source"]}

    def __call__(self, *, inputs, template=(), grid, threadgroup, output_shapes, output_dtypes, **kwargs):
        CALLS.append({"kernel": self.spec["name"], "backend": self.backend,
                      "inputs": [[list(a.shape), str(a.dtype)] for a in inputs],
                      "template": [[k, v if isinstance(v, (int, float)) else str(v)] for k, v in template],
                      "grid": list(grid), "threadgroup": list(threadgroup),
                      "outputs": [[list(s), str(d)] for s, d in zip(output_shapes, output_dtypes)]})
        return [mx.zeros(tuple(s), dtype=d) for s, d in zip(output_shapes, output_dtypes)]


def _install_stubs(backend: str) -> None:
    mx.fast.cuda_kernel = lambda **spec: _Recorder("cuda", **spec)
    mx.fast.metal_kernel = lambda **spec: _Recorder("metal", **spec)
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "") or ""
        if not name.startswith("kvq"):
            continue
        if hasattr(mod, "gpu_backend"):
            mod.gpu_backend = lambda: backend
        if hasattr(mod, "first_use_check"):
            mod.first_use_check = lambda *a, **k: True


def _problems():
    """(method, params dict, head_dim, H_q, H_kv, T_q, T, dtype): a fixed sweep over what the kernels serve."""
    out = []
    for dtype in (mx.float16, mx.bfloat16):
        for D in (64, 128, 256):
            for hq, hkv, tq in ((8, 8, 1), (8, 2, 1), (8, 2, 2), (16, 2, 1)):
                out.append(("turboquant", {"bits": 4}, D, hq, hkv, tq, 700, dtype))
            out.append(("turboquant", {"bits": 3}, D, 8, 2, 1, 3000, dtype))
            out.append(("turboquant", {"bits": 2}, D, 8, 2, 1, 300, dtype))
            out.append(("affine", {"bits": 4, "group_size": 64}, D, 8, 2, 1, 700, dtype))
            out.append(("affine", {"bits": 8, "group_size": 32}, D, 8, 2, 2, 300, dtype))
        out.append(("turboquant", {"bits": 4, "rotation": "qr"}, 128, 8, 2, 1, 300, dtype))
        out.append(("turboquant_rvq", {"bits": 2, "residual_bits": 2}, 128, 8, 2, 1, 700, dtype))
    out.append(("turboquant", {"bits": 4}, 96, 8, 2, 1, 300, mx.float32))
    return out


def _stream_problems():
    """The code-stream methods' problems, as :func:`_problems` plus the values' (method, params dict): ``qjl``
    keys with affine values, ``turboquant_prod``, ``vecinfer`` (params made by :func:`_vecinfer_params`)."""
    out = []
    for dtype in (mx.float16, mx.bfloat16):
        for hq, hkv, tq in ((8, 8, 1), (8, 2, 1), (8, 2, 2)):
            for D in (64, 128):
                out.append(("qjl", {}, D, hq, hkv, tq, 700, dtype, ("affine", {"bits": 4})))
                out.append(("turboquant_prod", {"bits": 4}, D, hq, hkv, tq, 700, dtype, None))
            out.append(("vecinfer", {}, 64, hq, hkv, tq, 700, dtype, None))
        out.append(("qjl", {"outlier_channels": 8, "sketch_dim": 256}, 128, 8, 2, 1, 300, dtype,
                    ("affine", {"bits": 8, "group_size": 32})))
        out.append(("turboquant_prod", {"bits": 3}, 128, 8, 2, 1, 3000, dtype, None))
        out.append(("turboquant_prod", {"bits": 4}, 256, 8, 2, 1, 300, dtype, None))
    return out


def _vecinfer_params(kv_heads: int):
    """Key and value parameters of a VecInfer calibration (sub_dim 4, 6-bit codes, head_dim 64, ``kv_heads``
    heads) made on synthetic tokens and written under ``$KVQ_DATA_DIR`` (the caller sets it)."""
    import numpy as np
    from kvq_backends_vecinfer.calibrate import Options, calibrate
    from kvq_backends_vecinfer.collect import Recording
    from kvq_backends_vecinfer.params import VecInferParams

    model_id = f"record-calls-{kv_heads}"
    settings = [VecInferParams(role=r, sub_dim=4, code_bits=6) for r in ("keys", "values")]
    rng = np.random.default_rng(0)
    tokens = [mx.array(rng.standard_normal((kv_heads, 512, 64)).astype(np.float32)) for _ in range(2)]
    calibrate(Recording(tokens[:1], tokens[1:], (0,)), model_id, settings,
              Options(iterations=2, points_per_centroid=8), progress=False)
    return [VecInferParams(role=s.role, sub_dim=4, code_bits=6, model_id=model_id).for_layer(0) for s in settings]


def _drive_steps(impl, q, keys, values, scale, x, dtype) -> None:
    """The bound decode steps a cache replays: ``bind_dense`` with sinks and without, and ``bind_ragged_dense``
    over two rows, each called for three steps with a window of 40, 41 and 42 tokens."""
    sk, sv = x[0][:, :, :4], x[1][:, :, :4]
    wk, wv = x[0][:, :, -42:], x[1][:, :, -42:]
    for label, sinks in (("bind_dense", (sk, sv)), ("bind_dense_no_sinks", (None, None))):
        CALLS.append({"op": label})
        step = impl.bind_dense(q, keys, values, scale, *sinks, wk[:, :, :40], wv[:, :, :40])
        CALLS.append({"bound": step is not None})
        for n in (40, 41, 42) if step is not None else ():
            CALLS.append({"step": n})
            mx.eval(step(q, wk[:, :, :n], wv[:, :, :n]))
    if not hasattr(impl, "bind_ragged_dense"):
        return
    CALLS.append({"op": "bind_ragged_dense"})
    both = lambda a: mx.concatenate([a, a[:, :, ::-1]], axis=0)  # noqa: E731 - two rows of one batch
    pure = kvq_registry().implementations[(keys.method, "mlx")]
    keys2 = pure.kvq_quantize(both(x[0]), keys.params)
    values2 = kvq_registry().implementations[(values.method, "mlx")].kvq_quantize(both(x[1]), values.params)
    q2 = mx.concatenate([q, q[:, ::-1]], axis=0)
    step = impl.bind_ragged_dense(q2, keys2, values2, scale, both(sk), both(sv), both(wk)[:, :, :40],
                                  both(wv)[:, :, :40])
    CALLS.append({"bound": step is not None})
    T = keys.num_tokens
    for n in (40, 41, 42) if step is not None else ():
        CALLS.append({"step": n})
        lengths = mx.array([[T - 5, n], [T, n - 3]], dtype=mx.int32)
        mx.eval(step(q2, both(wk)[:, :, :n], both(wv)[:, :, :n], lengths))


def kvq_registry():
    """kvq's plugin registry (imported late: the stubs go in after kvq loads)."""
    from kvq.plugins import registry

    return registry()


def record(backend: str) -> dict:
    """Run the sweep with stubbed ``backend`` kernels; return ``{"calls": [...], "kernels": {...}}``."""
    import kvq
    from kvq.attention import DenseTokens
    from kvq.plugins import registry

    reg = registry()
    _install_stubs(backend)
    warnings.simplefilter("ignore")
    skipped = []
    problems = [(*p, None) for p in _problems()] + _stream_problems()
    vecinfer = {}
    for method, kw, D, hq, hkv, tq, T, dtype, value_spec in problems:
        impl = reg.implementations.get((method, backend))
        pure = reg.implementations.get((method, "mlx"))
        if impl is None or pure is None:
            skipped.append(method)
            continue
        if method == "vecinfer":
            if hkv not in vecinfer:
                vecinfer[hkv] = _vecinfer_params(hkv)
            params, value_params = vecinfer[hkv]
        else:
            params = value_params = kvq.make_params(method, **kw)
        value_pure = pure
        if value_spec is not None:
            value_params = kvq.make_params(value_spec[0], **value_spec[1]).for_head_dim(D)
            value_pure = reg.implementations[(value_spec[0], "mlx")]
        key = mx.random.key(D + T)
        x = mx.random.normal((2, 1, hkv, T, D), key=key).astype(dtype)
        q = mx.random.normal((1, hq, tq, D), key=mx.random.key(7)).astype(dtype)
        CALLS.append({"problem": [method, kw, D, hq, hkv, tq, T, str(dtype)]
                      + ([] if value_spec is None else [list(value_spec)])})
        keys, values = pure.kvq_quantize(x[0], params), value_pure.kvq_quantize(x[1], value_params)
        mx.eval(keys.data, values.data)
        for op in ("quantize", "dequantize", "attend", "attend_dense"):
            CALLS.append({"op": op})
            if op == "quantize" and hasattr(impl, "kvq_quantize"):
                enc = impl.kvq_quantize(x[0], params)
                mx.eval(enc.data)
            elif op == "dequantize" and hasattr(impl, "kvq_dequantize"):
                mx.eval(impl.kvq_dequantize(keys, dtype))
            elif op == "attend" and hasattr(impl, "kvq_attend"):
                mx.eval(impl.kvq_attend(q, keys, values, D ** -0.5, None))
            elif op == "attend_dense" and hasattr(impl, "attend_dense"):
                sk, sv = x[0][:, :, :4], x[1][:, :, :4]
                wk, wv = x[0][:, :, -40:], x[1][:, :, -40:]
                got = impl.attend_dense(q, keys, values, D ** -0.5, DenseTokens(sk, sv, wk, wv))
                if got is not None:
                    mx.eval(got)
        if hasattr(impl, "bind_dense"):
            _drive_steps(impl, q, keys, values, D ** -0.5, x, dtype)
    return {"calls": CALLS, "kernels": BUILT, "skipped": sorted(set(skipped))}


def _normalised(record: dict) -> tuple[list, dict]:
    """Calls and kernels with the source hash dropped from kernel names (``kvq_NAME_<12 hex>`` -> ``kvq_NAME``)."""
    norm = lambda name: re.sub(r"_[0-9a-f]{12}$", "", name)  # noqa: E731
    calls = [dict(c, kernel=norm(c["kernel"])) if "kernel" in c else c for c in record["calls"]]
    kernels = {norm(k): {f: v for f, v in spec.items() if f not in ("source_sha", "text")}
               for k, spec in record["kernels"].items()}
    return calls, kernels


def preprocessed_tokens(text: str) -> list[str]:
    """``text`` run through ``clang++ -E -P`` (macros and conditionals expanded; MLX's template arguments stay
    names), split into tokens. :raises FileNotFoundError: no clang++ on PATH."""
    clang = shutil.which("clang++")
    if clang is None:
        raise FileNotFoundError("clang++ is not on PATH (apt-get install clang)")
    done = subprocess.run([clang, "-E", "-P", "-x", "c++", "-"], input=text, capture_output=True, text=True)
    return re.findall(r"[A-Za-z_][A-Za-z0-9_]*|\d[\w.]*|\S", done.stdout)


def compare(before: dict, after: dict) -> tuple[bool, str]:
    """``(same, verdict)`` of two records (see the module docstring)."""
    if before["calls"] == after["calls"] and before["kernels"].keys() == after["kernels"].keys():
        return True, "identical (same kernel names and sources, same calls)"
    (calls_a, kernels_a), (calls_b, kernels_b) = _normalised(before), _normalised(after)
    if calls_a != calls_b:
        for i, (a, b) in enumerate(zip(calls_a, calls_b)):
            if a != b:
                return False, f"calls differ at entry {i}:\n before {a}\n after  {b}"
        return False, f"call lists differ in length: {len(calls_a)} before, {len(calls_b)} after"
    if kernels_a != kernels_b:
        return False, f"kernels built differ: {sorted(set(kernels_a) ^ set(kernels_b)) or 'inputs/outputs'}"
    if not all("text" in spec for rec in (before, after) for spec in rec["kernels"].values()):
        return False, "calls identical up to kernel names; a record holds no sources to compare (an older record)"
    texts_a = {re.sub(r"_[0-9a-f]{12}$", "", k): v["text"] for k, v in before["kernels"].items()}
    texts_b = {re.sub(r"_[0-9a-f]{12}$", "", k): v["text"] for k, v in after["kernels"].items()}
    renamed = sorted(k for k in texts_a if texts_a[k] != texts_b[k])
    for name in renamed:
        if preprocessed_tokens(texts_a[name]) != preprocessed_tokens(texts_b[name]):
            return False, f"calls identical up to kernel names, but {name}'s source preprocesses differently"
    return True, (f"identical up to kernel names: {len(renamed)} renamed kernel(s) ({', '.join(renamed)}) "
                  "preprocess to the same tokens as before; every call the same")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "metal"))
    ap.add_argument("--compare", help="an earlier run's JSON: exit 1 unless every call is identical")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["KVQ_DATA_DIR"] = tmp  # VecInfer's calibration of synthetic tokens goes here
        result = record(args.backend)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    n = sum(1 for c in result["calls"] if "kernel" in c)
    print(f"{n} kernel calls, {len(result['kernels'])} kernels built ({args.backend}); skipped: "
          f"{result['skipped'] or 'none'}")
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        same, verdict = compare(before, result)
        print(f"against {args.compare}: {verdict}")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
