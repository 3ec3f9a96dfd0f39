"""Compile every instantiation of the fused prefill attention kernel (``kvq_metal.prefill``, issue #51) with ``nvcc``
on a machine without a GPU, and print registers, spills, stack frame and static shared memory per instantiation.

MLX's ``mx.fast.cuda_kernel`` is replaced by nvcc_registers.py's recorder: :func:`kvq_metal.prefill.launch_plan`
gives each instantiation's template, the kernel object is called once with small inputs of the right dtypes, and
the translation unit MLX would compile is rebuilt around the recorded body (nvcc_registers.py's ``cuda_text``) and
compiled with ``nvcc -arch sm_XX -cubin -Xptxas -v``. No kernel runs. Instantiations: every served head_dim (64,
128, 256; ``--head-dims`` for others, with ``--columns`` key columns per tile and all value coordinates per block),
float16 and bfloat16, with and without sink logits, 1 and 4 intervals per row, for sm_90 and sm_80. The static
shared memory ptxas reports is checked against the launch plan's ``shared_bytes``. Exit status 1 if any
instantiation fails to compile, spills, or declares other shared memory than planned.

    python benchmarks/investigations/nvcc_prefill.py [--keep DIR] [--archs sm_90,sm_80] [--head-dims 64,128,256]
        [--minb N] [--warpgroups N] [--pipeline]

``--warpgroups N`` records the ``wgmma`` form (template ``WG``, N warpgroups a block, as on an H100 or H200 with
``PrefillKnobs.warpgroups`` N) for the head_dims it serves and compiles it for sm_90a only; ``--pipeline`` its
pipelined schedule (template ``PIPE``, ``PrefillKnobs.pipeline``). ptxas's note that it serialised the wgmma
instructions (it could not prove a register of one in flight untouched) counts as a failure: the form would run,
slowly.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
import nvcc_registers  # noqa: E402  (its recorder and translation unit)


def ptxas_line(stderr: str) -> dict:
    """Registers, spill stores and loads, stack frame and static shared memory of the kernel in ptxas's -v report."""
    entry = stderr[stderr.index("Compiling entry function"):]

    def first(pattern: str) -> int:
        found = re.findall(pattern, entry)
        return int(found[0]) if found else 0

    return {"serialized": "wgmma.mma_async instructions are serialized" in stderr,
            "registers": first(r"Used (\d+) registers"), "spill_stores": first(r"(\d+) bytes spill stores"),
            "spill_loads": first(r"(\d+) bytes spill loads"), "stack": first(r"(\d+) bytes stack frame"),
            "smem": first(r"(\d+) bytes smem")}


def record(D: int, dtype: mx.Dtype, sinks: bool, intervals: int, minb: int = 0,
           warpgroups: int = 0, pipeline: bool = False) -> tuple[dict, int]:
    """The recorded launch of one instantiation (with ``__launch_bounds__(THREADS, minb)`` for ``minb`` > 0,
    the ``wgmma`` form with ``warpgroups`` > 0: :class:`kvq_metal.knobs.PrefillKnobs`) and its planned static
    shared memory."""
    from kvq_metal import prefill

    nvcc_registers.RECORDED.clear()
    q = mx.zeros((1, 4, 16, D), dtype)
    kv = mx.zeros((1, 1, 64, D), dtype)
    iv = mx.zeros((16, intervals, 2), mx.int32)
    plan = prefill.launch_plan(q.shape, kv.shape, dtype, intervals, D ** -0.5, sinks, minb, warpgroups, pipeline)
    saved, device = prefill.TUNING, prefill._wgmma_device
    prefill.TUNING = attrs.evolve(saved, minb={D: minb}, warpgroups=warpgroups, pipeline=pipeline)
    prefill._wgmma_device = lambda: warpgroups > 0  # the device launch() asks about: one with wgmma where asked for
    try:  # the library's own launch, recorded (mx.fast.cuda_kernel is the recorder)
        prefill.launch(q, kv, kv, iv, D ** -0.5, mx.zeros((4,), mx.float32) if sinks else None)
    finally:
        prefill.TUNING, prefill._wgmma_device = saved, device
    return nvcc_registers.RECORDED[0], plan.shared_bytes


def compile_one(kw: dict, arch: str, path: Path) -> dict:
    """Write the translation unit of a recorded launch to ``path``, compile it for ``arch``; ptxas's numbers, or
    ``{"error": ...}``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(nvcc_registers.cuda_text(kw))
    r = subprocess.run(["nvcc", f"-arch={arch}", "-std=c++17", "-cubin", "-o", str(path) + ".cubin", "-Xptxas",
                        "-v", str(path)], capture_output=True, text=True)
    if r.returncode:
        return {"error": r.stderr[-4000:]}
    return ptxas_line(r.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", default=None, help="write the .cu files here")
    ap.add_argument("--head-dims", default="64,128,256", help="comma-separated head_dims")
    ap.add_argument("--columns", type=int, default=32, help="key columns per tile for a head_dim without a plan")
    ap.add_argument("--archs", default="sm_90,sm_80")
    ap.add_argument("--minb", type=int, default=0, help="blocks per SM the registers must fit (0: no bound)")
    ap.add_argument("--warpgroups", type=int, default=0, help="the wgmma form, N warpgroups a block (sm_90a)")
    ap.add_argument("--pipeline", action="store_true", help="the wgmma form's pipelined schedule (with --warpgroups)")
    args = ap.parse_args()
    if args.warpgroups:
        args.archs = "sm_90a"
    if shutil.which("nvcc") is None:
        raise SystemExit("nvcc not found")
    mx.fast.cuda_kernel = lambda **kw: nvcc_registers._Recorder(**kw)
    from kvq_metal import prefill

    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for D in map(int, args.head_dims.split(",")):
            prefill.TILE_COLUMNS.setdefault(D, args.columns)  # this process only: to compile an unserved head_dim
            prefill.VALUE_SLICE.setdefault(D, D)
            for dtype in prefill.DTYPES:
                for sinks in (False, True):
                    for intervals in (1, prefill.MAX_INTERVALS):
                        if args.warpgroups and not prefill.wgmma_serves(D):
                            continue
                        kw, planned = record(D, dtype, sinks, intervals, args.minb, args.warpgroups, args.pipeline)
                        for arch in args.archs.split(","):
                            name = f"D{D}_{str(dtype).split('.')[-1]}_sink{int(sinks)}_P{intervals}_{arch}"
                            got = compile_one(kw, arch, Path(args.keep or tmp) / f"{name}.cu")
                            if "error" in got:
                                print(f"{name}: FAILED\n{got['error']}")
                                bad += 1
                                continue
                            flags = []
                            if got["spill_stores"] or got["spill_loads"]:
                                flags.append("SPILLS")
                            if got["serialized"]:
                                flags.append("WGMMA SERIALIZED")
                            if got["smem"] != planned:
                                flags.append(f"SHARED != planned {planned}")
                            bad += bool(flags)
                            print(f"{name}: registers {got['registers']} spill stores {got['spill_stores']} loads "
                                  f"{got['spill_loads']} stack {got['stack']} smem {got['smem']} B (BC "
                                  f"{prefill.TILE_COLUMNS[D]}) {' '.join(flags)}", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
