"""Compile the streams kernels' CUDA launches with ``nvcc`` on a machine without a GPU, and print their registers,
spills and static shared memory (what limits occupancy; issue #21).

MLX's ``mx.fast.cuda_kernel`` is replaced by a recorder: each launch of
:func:`kvq_metal.streams.decode_attend_streams` (qjl+affine:4, turboquant_prod:4 and :3 at head_dim 128, 4 query
rows, with and without the sinks and window) records its kernel text, inputs and outputs; the signature MLX would
write is rebuilt around the body (every input with its ``_shape``, ``_strides`` and ``_ndim``), and ``nvcc -arch
sm_90 -cubin -Xptxas -v`` compiles it. No kernel runs; the outputs are zeros. ``--turboquant``: the tensor-core
decode kernel instead (``decode_attend_tc.cu``, a bound decode step with sinks and window: turboquant bits 4 and 3
at head_dim 128, bits 4 at 256, affine bits 4 at head_dim 128). The signature is MLX's (each input's shape and
strides passed by value as ``__grid_constant__`` arrays, ``mlx/backend/cuda/custom_kernel.cpp``), so the
registers and instructions are those of MLX's build up to NVRTC against nvcc. ``--sass``: with ``cuobjdump`` and
``nvdisasm`` on the PATH (pip's ``nvidia-cuda-cuobjdump``, ``nvidia-cuda-nvdisasm``), also the instructions of each
main loop (the loop holding a warp step's ``HMMA``: 32 compressed tokens by default), the bound step's hot path;
of the streams kernel too (the loop with the most ``HMMA``, its shortest instantiation).

    python benchmarks/investigations/nvcc_registers.py --tuning '{"nt": 1}' [--keep DIR] [--sass]
    python benchmarks/investigations/nvcc_registers.py --turboquant --tuning '{"qsh": true}' [--keep DIR] [--sass]

``--tuning`` overrides the launch knobs (:mod:`kvq_metal.knobs`; of the streams kernel, or with ``--turboquant``
of the tensor-core decode kernel) through ``benchmarks/knobs.py``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parents[1]))  # benchmarks/: knobs, profile_streams
from knobs import knobs_arg, tuned  # noqa: E402
from profile_streams import B, D, HKV, HQ, dense_tokens, encode, random_inputs  # noqa: E402  (their shared setup)
from streams_kernel_times import METHODS  # noqa: E402

RECORDED: list[dict] = []
TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.uint8: "uint8_t",
         mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.int32: "int32_t"}


class _Recorder:
    """Stands in for a kernel object of ``mx.fast.cuda_kernel``: records each call, returns zeros."""

    def __init__(self, **build) -> None:
        self.build = build

    def __call__(self, *, inputs, template, output_shapes, output_dtypes, **_):
        RECORDED.append(dict(self.build, inputs=inputs, template=template, output_dtypes=output_dtypes))
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]


def cuda_text(kw: dict) -> str:
    """The translation unit MLX would compile for one recorded launch (the kernel named as MLX names it,
    ``custom_kernel_NAME``, so a header's launch bounds, :func:`kvq_metal.dialect.launch_bounds`, apply)."""
    args = []
    for name, a in zip(kw["input_names"], kw["inputs"]):
        args += [f"const {TYPES[a.dtype]}* {name}", f"const __grid_constant__ Shape {name}_shape",
                 f"const __grid_constant__ Strides {name}_strides", f"const __grid_constant__ int {name}_ndim"]
    args += [f"{TYPES[d]}* {n}" for n, d in zip(kw["output_names"], kw["output_dtypes"])]
    consts = "".join(f"  constexpr {'bool' if type(v) is bool else 'int'} {k} = "
                     f"{str(v).lower() if type(v) is bool else v};\n"
                     for k, v in kw["template"] if type(v) in (bool, int))
    consts += "".join(f"  using {k} = {TYPES[v]};\n" for k, v in kw["template"] if isinstance(v, mx.Dtype))
    name = f"custom_kernel_{kw['name']}"
    # MLX's layout: the kernel in namespace mlx::core::cu, then (NVRTC's name expression) the name used after the
    # body, so a macro the header defines on the name must be gone by then
    return ("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n#include <cuda/std/array>\n"
            "using Shape = cuda::std::array<int32_t, 10>;\nusing Strides = cuda::std::array<int64_t, 10>;\n" +
            kw["header"] +
            f"\nnamespace mlx::core::cu {{\n__global__ void {name}({', '.join(args)}) {{\n{consts}{kw['source']}"
            f"\n}}\n}}\nvoid* kvq_name_expression = (void*)&mlx::core::cu::{name};\n")


def compile_recorded(kw: dict, path: Path) -> str:
    """Write the translation unit of a recorded launch to ``path``, compile it with nvcc (sm_90) and return a line:
    registers, spills, stack frame and static shared memory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cuda_text(kw))
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", "-o", str(path) + ".cubin", "-Xptxas", "-v",
                        str(path)], capture_output=True, text=True)
    if r.returncode:
        return f"rc {r.returncode}: {r.stderr[-4000:]}"
    entry = r.stderr[r.stderr.index("Compiling entry function"):]
    regs = re.findall(r"Used (\d+) registers", entry)[:1]
    spills = re.findall(r"(\d+) bytes spill stores", entry)[:1]
    stack = re.findall(r"(\d+) bytes stack frame", entry)[:1]
    smem = re.findall(r"(\d+) bytes smem", entry)[:1]
    return f"registers {regs} spill stores {spills} stack frame {stack} static shared {smem} bytes"


def main_loops(cubin: Path, hmma: int | None = None) -> list[tuple[int, dict]]:
    """The loops of a cubin's SASS that hold ``hmma`` ``HMMA`` instructions (the tensor-core decode kernel's warp
    step over ``16 NT`` compressed tokens holds ``2 NT D / 16``: the scores' and the values' products; loops that
    enclose it, with the uncompressed tokens' steps and the merge, hold more instructions; ``None``: of the loops
    that enclose no other, those with the most, the compressed tokens' steps: the uncompressed tokens' take one
    tile a step), each as
    ``(instructions, counts of the commonest opcodes)``; ``[]`` without ``cuobjdump``."""
    if shutil.which("cuobjdump") is None:
        return []
    sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True).stdout
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, re.M)]
    spans = [(int(m.group(1), 16), addr) for addr, text in ins
             if (m := re.search(r"BRA\s+(?:P\d, )?0x([0-9a-f]+)", text)) and int(m.group(1), 16) < addr]
    bodies = []
    for lo, hi in spans:
        body = [t for a, t in ins if lo <= a <= hi]
        # None: innermost loops only (an enclosing loop holds the HMMA of every loop inside it)
        if hmma is None and any(lo <= lo2 and hi2 <= hi and (lo2, hi2) != (lo, hi) for lo2, hi2 in spans):
            continue
        bodies.append((sum("HMMA" in t for t in body), body))
    most = hmma if hmma is not None else max((h for h, _ in bodies), default=0)
    loops = []
    for h, body in bodies:
        if h == most and h > 0:
            ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            loops.append((len(body), dict(ops.most_common(8))))
    return loops


def turboquant(keep: str | None, sass: bool = False) -> None:
    """The tensor-core decode kernel (a bound decode step, sinks and window included) of turboquant and affine."""
    import kvq
    from kvq.plugins import registry
    from kvq_backends_turboquant.kernels import turboquant as tq
    from kvq_metal import attend

    for method, bits, dim in (("turboquant", 4, 128), ("turboquant", 3, 128), ("turboquant", 4, 256),
                              ("affine", 4, 128), ("affine", 4, 256)):
        impl, pure = registry().implementations[(method, "cuda")], registry().implementations[(method, "mlx")]
        p = kvq.make_params(method, bits=bits)
        x = mx.random.normal((2, 1, 8, 300, dim)).astype(mx.bfloat16)
        keys, values = pure.kvq_quantize(x[0], p), pure.kvq_quantize(x[1], p)
        q = mx.random.normal((1, 32, 1, dim)).astype(mx.bfloat16)
        w = mx.random.normal((1, 8, 132, dim)).astype(mx.bfloat16)
        RECORDED.clear()
        call = (tq.rotated_dense_call(impl, q, keys, values, tq._side) if method == "turboquant"
                else impl._dense_call(q, keys, values))
        step = attend.bind_decode(q, dim ** -0.5, call, "cuda", sink_keys=w[:, :, :4], sink_values=w[:, :, :4],
                                  window_keys=w[:, :, 4:], window_values=w[:, :, 4:])
        step(q, w[:, :, 4:], w[:, :, 4:])
        kw = next(k for k in RECORDED if "attend_tc" in k["name"])
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(keep or tmp) / f"{method}_{bits}_{dim}.cu"
            line = compile_recorded(kw, path)
            nt = int(re.search(r"constexpr int NT = (\d+);", cuda_text(kw)).group(1))
            loops = main_loops(Path(str(path) + ".cubin"), 2 * nt * dim // 16) if sass else []
        print(f"{method}:{bits} head_dim {dim}: {line}")
        for n, ops in sorted(loops, key=lambda loop: loop[0])[:1]:  # the innermost: the others enclose it
            print(f"    main loop: {n} instructions per warp step of {16 * nt} compressed tokens {ops}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", default=None, help="write the .cu files here")
    ap.add_argument("--turboquant", action="store_true",
                    help="the tensor-core decode kernel (turboquant, affine) instead")
    ap.add_argument("--sass", action="store_true", help="also the main loops' instruction counts")
    ap.add_argument("--tuning", default="{}", type=knobs_arg, help="JSON knob overrides (kvq_metal.knobs)")
    args = ap.parse_args()
    if shutil.which("nvcc") is None:
        raise SystemExit("nvcc not found")
    mx.fast.cuda_kernel = lambda **kw: _Recorder(**kw)
    if args.turboquant:
        with tuned(attend=args.tuning):
            turboquant(args.keep, args.sass)
        return
    with tuned(streams=args.tuning):
        streams_kernels(args.keep, args.sass)


def streams_kernels(keep: str | None, sass: bool = False) -> None:
    """The streams kernel's launches (qjl+affine:4, turboquant_prod:4 and :3), without and with dense tokens."""
    from kvq_metal import streams

    for km, kp, vm, vp in METHODS:
        q, k, v, window = random_inputs(300)
        impl, keys, values, call = encode(km, kp, vm, vp, k, v, "cuda")
        _, finish = impl._matrices(keys, values, call)
        prepared = mx.random.normal((B, HKV, HQ // HKV, call.query_dim))
        dense = dense_tokens(window)
        for label, kwargs in (("codes", {}), ("codes+dense", dict(dense=dense, raw_queries=q, scale=D ** -0.5,
                                                                    finish=finish))):
            RECORDED.clear()
            streams.decode_attend_streams(prepared, call, "cuda", **kwargs)
            kw = RECORDED[0]  # the attention launch (the merge, RECORDED[1], follows)
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(keep or tmp) / f"{km}_{kp.get('bits', '')}_{label}.cu"
                line = compile_recorded(kw, path)
                loops = main_loops(Path(str(path) + ".cubin")) if sass else []
            print(f"{km}:{kp.get('bits', '')}+{vm}:{vp.get('bits', '')} {label}: kernel {kw['name']} {line}")
            merge = RECORDED[1]
            with tempfile.TemporaryDirectory() as tmp:
                merged = compile_recorded(merge, Path(keep or tmp) / f"{km}_{kp.get('bits', '')}_{label}_merge.cu")
            print(f"    merge {merge['name']}: {merged}")
            for n, ops in sorted(loops, key=lambda loop: loop[0])[:1]:  # the shortest: the vector-load path's
                print(f"    main loop: {n} instructions per warp step {ops}")

if __name__ == "__main__":
    main()
