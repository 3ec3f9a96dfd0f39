"""Host cost of one MLX custom-kernel launch on this GPU, against the size of its source and its argument count.

A decode step of a kvq layer launches custom kernels where mlx-lm's KVCache calls one SDPA, and decode on a big GPU
is limited by the host (``benchmarks/investigations/profile_host.py``). MLX's CUDA back end formats a custom kernel's whole source
(header included) into a new string on every call and hashes it again when the graph is evaluated
(``mlx/backend/cuda/custom_kernel.cpp`` in MLX 0.32), so the host cost of a launch may grow with the text of the
kernel. This script measures, for a chain of ``--calls`` dependent launches of a one-line kernel:

- ``build_us``: Python + graph building per call (nothing evaluated), and ``eval_us``: ``mx.eval`` of the chain per
  call (encoding, CUDA-graph building, the tiny kernels' run), for
  - a short source, and the same source padded with a comment to ``--pad`` bytes (a real decode kernel's size),
  - 15 inputs and 25 template arguments (what the tensor-core decode kernel takes), short source,
  - MLX's own ``mx.fast.scaled_dot_product_attention`` on a decode shape (what fp16 decode launches per layer);
- whether NVRTC resolves ``#include "<absolute path>"`` in a custom kernel (a kernel text kept on disk instead of
  in every call's string): the kernel's result is checked.

    python benchmarks/launch_cost.py --out launch.json

Writes one JSON object; prints a table. Not part of the library.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import mlx.core as mx

BODY = """
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < inp_shape[0]) out[i] = inp[i] + 1.0f;
"""


def chain(kernel, x, calls: int, extra_inputs=(), template=()):
    """``calls`` dependent launches of ``kernel``: (build seconds per call, eval seconds per call)."""
    mx.eval(x)
    mx.synchronize()
    tic = time.perf_counter()
    y = x
    for _ in range(calls):
        y = kernel(inputs=[y, *extra_inputs], template=list(template), grid=(x.size, 1, 1),
                   threadgroup=(256, 1, 1), output_shapes=[x.shape], output_dtypes=[x.dtype])[0]
    built = time.perf_counter()
    mx.eval(y)
    mx.synchronize()
    done = time.perf_counter()
    return (built - tic) / calls, (done - built) / calls, y


def measure(name, make, x, calls, reps, **kw):
    kernel = make()
    chain(kernel, x, 8, **kw)  # compile
    runs = [chain(kernel, x, calls, **kw)[:2] for _ in range(reps)]
    build = sorted(r[0] for r in runs)[len(runs) // 2] * 1e6
    ev = sorted(r[1] for r in runs)[len(runs) // 2] * 1e6
    print(f"{name:<44} build {build:8.2f} us/call   eval {ev:8.2f} us/call", flush=True)
    return {"name": name, "build_us": build, "eval_us": ev}


def decode_step_rows(calls: int, reps: int) -> list[dict]:
    """A turboquant:4 layer's bound decode step (4K compressed tokens, 4 sinks, a window of 100; 32 query / 8 KV
    heads, head_dim 128, bfloat16) launched ``calls`` times: as bound now (template values in the kernel's text,
    each array passed once: ``kvq_metal.dialect.Kernel.bound``) and as before (MLX's kernel object with the 26
    template arguments and all 17 inputs)."""
    from kvq.cache import KVQCache, make_config
    from kvq_metal import attend, attend_tc, dialect
    from kvq_metal.step import DecodeStep, KernelCall

    cache = KVQCache(make_config("turboquant", bits=4, flush=32))
    k = mx.random.normal((1, 8, 4096 + 132, 128)).astype(mx.bfloat16)
    cache.update_and_fetch(k, k)
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    mx.eval(cache.attend(q, 0.088))
    step = cache._bound[2]
    if not isinstance(step, DecodeStep) or not step.tensor_cores or step.launches[1] is not None:
        return [{"name": "bound decode step", "error": f"not a tensor-core step here: {type(step).__name__}"}]
    wk, wv = cache.window.keys[:, :, :100], cache.window.values[:, :, :100]
    kern = attend_tc.DECODE_ATTEND_TC.kernel("cuda", attend.TC_INPUTS, attend.TC_OUTPUTS,
                                            ensure_row_contiguous=False)
    # the step as it was bound before: every input, the template passed on every launch
    from kvq_backends_turboquant.kernels import turboquant as tqk
    dense_call = tqk._rotated_call(cache.compressed_keys.view(), cache.compressed_values.view(), tqk._side)
    codes = attend._code_inputs(dense_call.keys, dense_call.values, dense_call.signs)
    sinks = list(cache.sinks.view())
    old_inputs = [q, *codes, step._counter, wk, wv, *sinks]
    full = [*step.template_args, *dialect.dtype_template(tuple(a.dtype for a in old_inputs))]
    main = step.launches[0]
    old = DecodeStep(KernelCall(kern._kernel, full, main.grid, main.threadgroup, main.shapes, main.dtypes), codes,
                     sinks, counter=step._counter)
    rows = []
    for name, s in (("bound decode step, template in text, arrays once", step),
                    ("bound decode step, 26 template args, 17 inputs", old)):
        def run(n, s=s):
            mx.synchronize()
            tic = time.perf_counter()
            outs = [s(q, wk, wv) for _ in range(n)]
            built = time.perf_counter()
            mx.eval(outs)
            mx.synchronize()
            return (built - tic) / n, (time.perf_counter() - built) / n

        run(8)
        runs = [run(calls) for _ in range(reps)]
        row = {"name": name, "build_us": sorted(r[0] for r in runs)[reps // 2] * 1e6,
               "eval_us": sorted(r[1] for r in runs)[reps // 2] * 1e6}
        print(f"{row['name']:<44} build {row['build_us']:8.2f} us/call   eval {row['eval_us']:8.2f} us/call")
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--pad", type=int, default=38000, help="source bytes of the padded kernel")
    p.add_argument("--out", default="launch.json")
    args = p.parse_args()
    x = mx.random.normal((1024,))
    rows = []
    short = lambda: mx.fast.cuda_kernel(name="lc_short", input_names=["inp"], output_names=["out"], source=BODY)
    rows.append(measure("1 input, short source", short, x, args.calls, args.reps))
    pad = "// " + "x" * (args.pad - len(BODY)) + "\n"
    padded = lambda: mx.fast.cuda_kernel(name="lc_padded", input_names=["inp"], output_names=["out"],
                                         source=BODY, header=pad)
    rows.append(measure(f"1 input, {args.pad} B source", padded, x, args.calls, args.reps))
    names = ["inp"] + [f"e{i}" for i in range(14)]
    many = lambda: mx.fast.cuda_kernel(name="lc_many", input_names=names, output_names=["out"], source=BODY)
    extra = [mx.zeros((4, 4, 4, 4)) for _ in range(14)]
    template = [(f"T{i}", i) for i in range(25)]
    rows.append(measure("15 inputs, 25 template args, short", many, x, args.calls, args.reps,
                        extra_inputs=extra, template=template))
    rows.append(measure("15 inputs, no template args, short", many, x, args.calls, args.reps, extra_inputs=extra))
    few = lambda: mx.fast.cuda_kernel(name="lc_few", input_names=names[:9], output_names=["out"], source=BODY)
    rows.append(measure("9 inputs, no template args, short", few, x, args.calls, args.reps,
                        extra_inputs=extra[:8]))
    rows.append(measure("1 input, 25 template args, short", short, x, args.calls, args.reps, template=template))
    rows.extend(decode_step_rows(args.calls, args.reps))

    # SDPA on a decode shape: q [1, 32, 1, 128] over 4096 keys of 8 heads, chained through q
    k = mx.random.normal((1, 8, 4096, 128)).astype(mx.bfloat16)
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    mx.eval(k, q)

    def sdpa_chain(calls):
        tic = time.perf_counter()
        y = q
        for _ in range(calls):
            y = mx.fast.scaled_dot_product_attention(y, k, k, scale=0.088)
        built = time.perf_counter()
        mx.eval(y)
        mx.synchronize()
        return (built - tic) / calls, (time.perf_counter() - built) / calls

    sdpa_chain(8)
    runs = [sdpa_chain(args.calls) for _ in range(args.reps)]
    row = {"name": "mx.fast.scaled_dot_product_attention, 4K keys",
           "build_us": sorted(r[0] for r in runs)[args.reps // 2] * 1e6,
           "eval_us": sorted(r[1] for r in runs)[args.reps // 2] * 1e6}
    print(f"{row['name']:<44} build {row['build_us']:8.2f} us/call   eval {row['eval_us']:8.2f} us/call")
    rows.append(row)

    # an absolute #include: does NVRTC find a header on disk?
    include = {"name": "absolute #include"}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "lc_inc.cuh")
        with open(path, "w") as f:
            f.write("__device__ inline float lc_twice(float v) { return 2.0f * v; }\n")
        src = ("    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
               "    if (i < inp_shape[0]) out[i] = lc_twice(inp[i]);\n")
        try:
            kern = mx.fast.cuda_kernel(name="lc_include", input_names=["inp"], output_names=["out"], source=src,
                                       header=f'#include "{path}"\n')
            y = kern(inputs=[x], grid=(x.size, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape],
                     output_dtypes=[x.dtype])[0]
            include["works"] = bool(mx.allclose(y, 2 * x).item())
        except Exception as exc:  # noqa: BLE001 - the finding is whether it works
            include["works"] = False
            include["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    print("absolute #include:", include)
    rows.append(include)
    with open(args.out, "w") as f:
        json.dump({"device": str(mx.default_device()), "mlx": mx.__version__, "calls": args.calls, "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
