"""One kernel dialect, two back ends: kvq's kernels are written once and built for Metal or CUDA.

Kernel text lives in kernel files (``.kvq`` in this dialect, ``.cu`` for CUDA only), read by
:mod:`kvq_metal.kernel_files`; this module translates and builds them.

MLX builds custom kernels from a function body (``mx.fast.metal_kernel`` on Apple GPUs, ``mx.fast.cuda_kernel``
on NVIDIA GPUs; both take the grid in threads, not thread groups). A kernel body here uses these tokens, which
:func:`translate` rewrites textually for the back end (textual, not ``#define``: MLX's Metal builder only passes
``thread_position_in_grid`` and the other thread attributes when their names appear in the body):

=================  =====================================  ==================================
token              Metal                                  CUDA
=================  =====================================  ==================================
``KVQ_TG_X/Y``     ``threadgroup_position_in_grid.x/y``   ``blockIdx.x/y``
``KVQ_NTG_Y``      ``threadgroups_per_grid.y``            ``gridDim.y``
``KVQ_TID``        ``thread_position_in_threadgroup.x``   ``threadIdx.x``
``KVQ_GID``        ``thread_position_in_grid.x``          ``blockIdx.x * blockDim.x + threadIdx.x``
``KVQ_LANE``       ``thread_index_in_simdgroup``          ``threadIdx.x & 31``
``KVQ_WARP``       ``simdgroup_index_in_threadgroup``     ``threadIdx.x >> 5``
``KVQ_SHARED``     ``threadgroup``                        ``__shared__``
``KVQ_BARRIER()``  ``threadgroup_barrier(mem_threadgroup)``  ``__syncthreads()``
=================  =====================================  ==================================

and the prelude of each back end defines the rest as macros: ``KVQ_SHFL_XOR(x, m)`` and ``KVQ_SHFL(x, lane)``
(a 32-wide SIMD group / warp), ``KVQ_EXP``, ``KVQ_LOG``, ``KVQ_SQRT``, ``KVQ_FMAX``, ``KVQ_FMIN``, ``KVQ_INF``,
``KVQ_F32(x)`` (any float type to float), ``KVQ_AS_FLOAT(i)`` (the float whose IEEE-754 bits are the int ``i``:
float scalars travel as template arguments, see :func:`float_bits`), ``KVQ_NOT_FINITE(f)`` (a float32 NaN or
±inf, tested on its exponent bits, which fast-math builds cannot assume away), and the 64-bit unsigned type ``kvq_u64``;
CUDA also gets ``uint``.

No kernel reads a per-call scalar from an array made on the host: on MLX's CUDA back end every array is managed
(unified) memory, and arrays of at most 8 bytes share one pool whose pages the host writes whenever it makes a
scalar; the next kernel that reads such an array faults (on an H200 the decode-attention kernel's largest stall
in Nsight Compute; removing its two such reads took a 4K-token call from 56.6 to 36.8 us of GPU time). Sizes come
from the inputs' shapes and the grid, float scalars from template arguments.

Kernels are compiled once per template key: MLX caches compiled modules by kernel name plus template arguments,
so :func:`kernel` names each kernel by a hash of its translated source, and :class:`Kernel` adds every input's
dtype as a template argument (a kernel called with float16 and then float32 input is two kernels, never one
module reused with the wrong signature).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import struct
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Sequence

import mlx.core as mx

from kvq.paths import cache_root

BACKENDS = ("metal", "cuda")

_TOKENS = {
    "metal": {
        "KVQ_TG_X": "threadgroup_position_in_grid.x",
        "KVQ_TG_Y": "threadgroup_position_in_grid.y",
        "KVQ_TG_Z": "threadgroup_position_in_grid.z",
        "KVQ_NTG_Y": "threadgroups_per_grid.y",
        "KVQ_TID": "thread_position_in_threadgroup.x",
        "KVQ_GID": "thread_position_in_grid.x",
        "KVQ_LANE": "thread_index_in_simdgroup",
        "KVQ_WARP": "simdgroup_index_in_threadgroup",
        "KVQ_SHARED": "threadgroup",
        "KVQ_BARRIER()": "threadgroup_barrier(mem_flags::mem_threadgroup)",
    },
    "cuda": {
        "KVQ_TG_X": "blockIdx.x",
        "KVQ_TG_Y": "blockIdx.y",
        "KVQ_TG_Z": "blockIdx.z",
        "KVQ_NTG_Y": "gridDim.y",
        "KVQ_TID": "threadIdx.x",
        "KVQ_GID": "(blockIdx.x * blockDim.x + threadIdx.x)",
        "KVQ_LANE": "(threadIdx.x & 31u)",
        "KVQ_WARP": "(threadIdx.x >> 5)",
        "KVQ_SHARED": "__shared__",
        "KVQ_BARRIER()": "__syncthreads()",
    },
}

PRELUDES = {
    "metal": """
#define KVQ_SHFL_XOR(x, m) simd_shuffle_xor((x), (ushort)(m))
#define KVQ_SHFL(x, lane) simd_shuffle((x), (ushort)(lane))
#define KVQ_EXP(x) metal::exp(x)
#define KVQ_LOG(x) metal::log(x)
#define KVQ_SQRT(x) metal::sqrt(x)
#define KVQ_FMAX(a, b) metal::max((a), (b))
#define KVQ_FMIN(a, b) metal::min((a), (b))
#define KVQ_INF INFINITY
#define KVQ_F32(x) static_cast<float>(x)
#define KVQ_AS_FLOAT(i) as_type<float>((int)(i))
#define KVQ_NOT_FINITE(f) ((as_type<uint>(f) & 0x7f800000u) == 0x7f800000u)
typedef ulong kvq_u64;
""",
    "cuda": """
typedef unsigned int uint;
typedef unsigned long long kvq_u64;
#define KVQ_SHFL_XOR(x, m) __shfl_xor_sync(0xffffffffu, (x), (m))
#define KVQ_SHFL(x, lane) __shfl_sync(0xffffffffu, (x), (lane))
#define KVQ_EXP(x) expf(x)
#define KVQ_LOG(x) logf(x)
#define KVQ_SQRT(x) sqrtf(x)
#define KVQ_FMAX(a, b) fmaxf((a), (b))
#define KVQ_FMIN(a, b) fminf((a), (b))
#define KVQ_INF __int_as_float(0x7f800000)
#define KVQ_F32(x) static_cast<float>(x)
#define KVQ_AS_FLOAT(i) __int_as_float((int)(i))
#define KVQ_NOT_FINITE(f) ((__float_as_uint(f) & 0x7f800000u) == 0x7f800000u)
""",
}

#: Every kernel source built in this process, by kernel name (for :func:`sources_hash`).
SOURCES: dict[str, str] = {}


def gpu_backend() -> str | None:
    """The kernel back end of MLX's default device: ``"metal"``, ``"cuda"``, or ``None`` (CPU, or no GPU)."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


def float_bits(value: float) -> int:
    """The IEEE-754 float32 bits of ``value`` as a signed int: a template argument that a kernel turns back into
    the float with ``KVQ_AS_FLOAT`` (one compiled kernel per distinct value; for per-model constants such as the
    softmax scale). :raises ValueError: ``value`` is not finite."""
    if not math.isfinite(value):
        raise ValueError(f"value must be a finite float; got {value!r}")
    return struct.unpack("<i", struct.pack("<f", value))[0]


_SIZES: list = []


def size_input(n: int, name: str = "n") -> mx.array:
    """An input that carries the size ``n`` (>= 0) to a kernel in its shape: uint8 ``[n + 1]``, read in the kernel
    as ``<name>_shape[0] - 1``; its bytes are never read. For per-call sizes no other input's shape gives (the
    columns around a decode's output: :func:`kvq_backends_turboquant.kernels.quantize.dequantize_into`): a
    template argument would compile one kernel per value, and an array the host wrote would fault on CUDA's
    managed memory (module docstring), while MLX passes shapes by value. A prefix of one zero buffer per process,
    grown to the largest size asked, so it costs no launch and no allocation per call.

    :param name: what ``n`` is, for the error (``"before"``: the columns ahead of a decode's output).
    :raises ValueError: ``n`` negative (naming ``name``)."""
    if n < 0:
        raise ValueError(f"{name} must be >= 0; got {n}")
    if not _SIZES or _SIZES[0].size < n + 1:
        buffer = mx.zeros((max(n + 1, 2 * _SIZES[0].size if _SIZES else 1 << 16),), mx.uint8)
        mx.eval(buffer)
        _SIZES[:] = [buffer]
    return _SIZES[0][: n + 1]


def translate(source: str, backend: str) -> str:
    """Rewrite the dialect tokens of ``source`` for ``backend``.

    :raises ValueError: ``backend`` not one of :data:`BACKENDS`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    tokens = _TOKENS[backend]
    pattern = re.compile("|".join(re.escape(t) + (r"\b" if t[-1].isalnum() else "") for t in
                                  sorted(tokens, key=len, reverse=True)))
    return pattern.sub(lambda m: tokens[m.group(0)], source)


class Kernel:
    """A compiled-on-first-call MLX custom kernel for one back end (see the module docstring).

    Call it like MLX's kernel objects: ``kernel(inputs=[...], template=[...], grid=..., threadgroup=...,
    output_shapes=[...], output_dtypes=[...])``. The inputs' dtypes are appended to ``template`` as a few integers
    (:func:`dtype_template`): MLX names a compiled kernel by its template values, and the generated signature
    types each input pointer by its dtype, so the dtypes must be part of the name or a kernel compiled for
    float16 inputs would serve bfloat16 ones.

    On CUDA the text handed to MLX is two ``#include`` lines of files holding the translated header and body
    (:func:`cuda_text`), where NVRTC reads such files here: MLX formats a custom kernel's whole text into a new
    string on every launch and hashes it again when the launch is evaluated, so a 36 KB kernel costs the host
    that much per launch (``benchmarks/launch_cost.py``).
    """

    def __init__(self, name: str, backend: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str, ensure_row_contiguous: bool) -> None:
        body, head = translate(source, backend), PRELUDES[backend] + translate(header, backend)
        digest = hashlib.sha256((head + body).encode()).hexdigest()[:12]
        self.name = f"kvq_{name}_{digest}"
        self.backend = backend
        self.input_names = tuple(input_names)
        SOURCES[self.name] = head + body
        build = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
        self._uses = shape_uses(body, self.input_names)  # of the translated text, before it becomes include lines
        if backend == "cuda":
            head, body = cuda_text(self.name, head, body, self.input_names)
        self._build = dict(input_names=list(input_names), output_names=list(output_names), header=head,
                           ensure_row_contiguous=ensure_row_contiguous)
        self._body = body
        self._kernel = build(name=self.name, source=body, **self._build)
        self._baked: dict[tuple, object] = {}

    def __call__(self, *, inputs, template=(), **kwargs):
        types = dtype_template(tuple(a.dtype for a in inputs))
        return self._kernel(inputs=inputs, template=[*template, *types], **kwargs)

    def bound(self, template, inputs: Sequence[mx.array], aliases: Mapping[str, str] | None = None,
              shared_memory: int = 0) -> tuple:
        """``(call, full_template, kept)`` for a hot path that launches this kernel many times with inputs like
        ``inputs`` (same dtypes; :class:`kvq_metal.attend.DecodeStep`): ``call`` takes the keyword arguments of
        :meth:`__call__` with ``template=full_template`` and the inputs at the positions ``kept`` only.

        On CUDA ``call`` is a kernel object of its own with the template's values written into its text as the
        ``constexpr`` lines MLX would write (:func:`baked_source`), and ``full_template`` is empty: MLX converts and
        formats every template argument into a kernel's name and text on every launch, which the tensor-core
        decode kernel's 26 arguments made the dearest part of its launch (``benchmarks/launch_cost.py``). Each
        input named in ``aliases`` (input name -> the name of an earlier input that holds the same array) is left
        out of that kernel's signature and read through the other (``#define`` lines), so a launch passes fewer
        arrays. A template with ``MINB`` > 0 also gets ``__launch_bounds__(THREADS, MINB)`` (:func:`launch_bounds`).
        Both compile to the same arithmetic. ``shared_memory`` (CUDA): the dynamic shared memory, bytes, each block
        of that kernel is launched with (MLX's ``cuda_kernel(shared_memory=)``, fixed per kernel object; above 48 KB
        MLX raises the kernel's limit). Elsewhere (Metal, or a
        template value that is not a bool or an int) ``call`` is MLX's kernel object, ``full_template`` ``template``
        with the dtype arguments appended
        (what :meth:`__call__` computes on every call) and every input is kept.

        :raises TypeError: an input dtype without a code (:func:`dtype_template`).
        :raises ValueError: ``aliases`` naming an input this kernel does not take, or an alias of an alias, or
            ``shared_memory`` asked of a kernel this method does not build (Metal, or a template that is not all
            bools and ints)."""
        aliases = dict(aliases or {})
        names = self.input_names
        unknown = [n for pair in aliases.items() for n in pair if n not in names]
        if unknown or any(target in aliases for target in aliases.values()):
            raise ValueError(f"aliases must map inputs of {self.name} ({', '.join(names)}) to kept inputs; got "
                             f"{aliases!r}")
        kept = tuple(i for i, n in enumerate(names) if n not in aliases)
        if self.backend != "cuda" or not all(type(v) in (bool, int) for _, v in template):
            if shared_memory:
                raise ValueError(f"shared_memory: dynamic shared memory is given to baked CUDA kernels only; got "
                                 f"{shared_memory} bytes for {self.name} on {self.backend}")
            return self._kernel, [*template, *dtype_template(tuple(a.dtype for a in inputs))], tuple(range(len(names)))
        full = (*template, *dtype_template(tuple(inputs[i].dtype for i in kept)))
        key = (full, tuple(sorted(aliases.items())), int(shared_memory))
        call = self._baked.get(key)
        if call is None:
            digest = hashlib.sha256(repr(key).encode()).hexdigest()[:12]
            source = baked_source(full, self._body, aliases, self._uses)
            build = dict(self._build, input_names=[names[i] for i in kept])
            name = f"{self.name}_b{digest}"
            define, undefine = launch_bounds(name, dict(template))
            build["header"] += define
            if shared_memory:
                build["shared_memory"] = int(shared_memory)
            call = self._baked[key] = mx.fast.cuda_kernel(name=name, source=undefine + source, **build)
        return call, [], kept


def launch_bounds(name: str, template: Mapping[str, object]) -> tuple[str, str]:
    """``(header line, body line)`` that give the CUDA kernel MLX builds for ``name`` a ``__launch_bounds__(THREADS,
    MINB)`` where ``template`` asks for one (``MINB`` > 0, ``THREADS`` its block size), else ``("", "")``.

    MLX writes the kernel as ``__global__ void custom_kernel_NAME(...)`` after the header
    (``mlx/backend/cuda/custom_kernel.cpp``) and takes no launch bounds, so the header line defines that name as a
    macro which puts the attribute before it (a macro's own name is not expanded again), and the body line, the
    first of the body, undefines it: MLX asks NVRTC for the kernel by that name in an expression compiled after the
    body, which must see the plain name (with the macro still defined, NVRTC fails to parse it: found on the H200).
    The compiler then keeps the registers per thread within what ``MINB`` blocks of ``THREADS`` threads per SM
    allow. Registers only: the arithmetic, and so every result, is the same."""
    minb = int(template.get("MINB", 0))
    if minb <= 0:
        return "", ""
    macro = f"custom_kernel_{name}"
    return (f"\n#define {macro} __launch_bounds__({int(template['THREADS'])}, {minb}) {macro}\n",
            f"#undef {macro}\n")


def baked_source(template, body: str, aliases: Mapping[str, str] | None = None,
                 uses: Sequence[str] = ()) -> str:
    """``body`` preceded by ``template``'s values as the ``constexpr`` lines MLX's CUDA kernel builder writes at
    the top of a kernel's body for template arguments (``mlx/backend/cuda/custom_kernel.cpp``): ``constexpr int
    NAME = value;`` and ``constexpr bool NAME = true|false;``, and by a ``#define`` of each alias (an input left
    out of the signature, read through another: its pointer and its ``_shape``, ``_strides`` and ``_ndim``). A
    kernel built from this text with no template arguments compiles to the kernel that ``body`` with
    ``template`` compiles to. ``uses`` are the ``_shape``/``_strides``/``_ndim`` names the body reads
    (:func:`shape_uses`): a comment naming them through the aliases tells MLX which the kept inputs must pass.

    :raises TypeError: a value that is neither a bool nor an int."""
    lines = []
    for name, value in template:
        if type(value) is bool:
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
        elif type(value) is int:
            lines.append(f"  constexpr int {name} = {value};\n")
        else:
            raise TypeError(f"template values must be bool or int to be written into a kernel's text; {name} is "
                            f"{value!r}")
    aliases = aliases or {}
    for name, target in aliases.items():
        lines.append(f"#define {name} {target}\n")
        lines.extend(f"#define {name}_{what} {target}_{what}\n" for what in ("shape", "strides", "ndim"))
    if aliases and uses:
        mapped = []
        for use in uses:
            name, what = use.rsplit("_", 1)
            use = f"{aliases.get(name, name)}_{what}"
            if use not in mapped:
                mapped.append(use)
        lines.append(f"// reads {' '.join(mapped)}\n")
    return "".join(lines) + "\n" + body


def kernel_dir() -> Path:
    """Where kernel texts are written for NVRTC to include: ``kernels/`` under kvq's cache folder
    (:func:`kvq.paths.cache_root`). Files are named by a hash of their text, so they never go stale."""
    return cache_root() / "kernels"


def _write_once(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` unless it is there already (atomically: a temporary file renamed into place)."""
    if path.is_file() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def shape_uses(source: str, input_names: Sequence[str]) -> list[str]:
    """The ``<input>_shape``, ``<input>_strides`` and ``<input>_ndim`` names ``source`` uses: MLX's CUDA kernel
    builder passes an input's shape, strides or rank only where its body contains that name."""
    return [f"{n}_{what}" for n in input_names for what in ("shape", "strides", "ndim") if f"{n}_{what}" in source]


@lru_cache(maxsize=1)
def includes_work() -> bool:
    """Whether MLX's CUDA kernels here can ``#include`` a file by absolute path (NVRTC reads it from disk): a tiny
    kernel that includes one is built and run once per process, on a machine whose default device is a CUDA GPU.
    ``KVQ_KERNEL_INCLUDES=0`` turns the include form off (the kernel text is then handed to MLX whole)."""
    if os.environ.get("KVQ_KERNEL_INCLUDES", "1") == "0" or gpu_backend() != "cuda":
        return False
    try:
        text = "__device__ inline float kvq_probe_twice(float v) { return 2.0f * v; }\n"
        path = kernel_dir() / f"kvq_probe_{hashlib.sha256(text.encode()).hexdigest()[:12]}.cuh"
        _write_once(path, text)
        probe = mx.fast.cuda_kernel(name="kvq_include_probe", input_names=["inp"], output_names=["out"],
                                    source="    out[threadIdx.x] = kvq_probe_twice(inp[threadIdx.x]);\n",
                                    header=f'#include "{path}"\n')
        x = mx.array([1.0, 2.0])
        y = probe(inputs=[x], grid=(2, 1, 1), threadgroup=(2, 1, 1), output_shapes=[(2,)],
                  output_dtypes=[mx.float32])[0]
        return y.tolist() == [2.0, 4.0]
    except Exception:  # noqa: BLE001 - any failure (read-only cache dir, NVRTC without file access) means: inline
        return False


def cuda_text(name: str, head: str, body: str, input_names: Sequence[str]) -> tuple[str, str]:
    """``(header, source)`` to hand ``mx.fast.cuda_kernel`` for a kernel named ``name``: ``#include`` lines of
    files holding ``head`` and ``body`` (:func:`kernel_dir`), with a comment naming the shapes and strides the body
    reads (MLX decides from the source which to pass, :func:`shape_uses`), where :func:`includes_work`; else
    ``(head, body)`` themselves. Both compile to the same kernel."""
    if not includes_work():
        return head, body
    folder = kernel_dir()
    try:
        _write_once(folder / f"{name}.cuh", head)
        _write_once(folder / f"{name}.cu", body)
    except OSError:
        return head, body
    uses = shape_uses(body, input_names)
    source = f'#include "{folder / name}.cu"\n// reads {" ".join(uses)}\n'
    if shape_uses(source, input_names) != uses:  # an input name inside another's: keep MLX's view of the body
        return head, body
    return f'#include "{folder / name}.cuh"\n', source


#: A fixed code per dtype (never renumber: compiled kernels are named by these values).
DTYPE_CODES = {mx.bool_: 1, mx.uint8: 2, mx.uint16: 3, mx.uint32: 4, mx.uint64: 5, mx.int8: 6, mx.int16: 7,
               mx.int32: 8, mx.int64: 9, mx.float16: 10, mx.bfloat16: 11, mx.float32: 12, mx.complex64: 13,
               mx.float64: 14}
#: Input dtypes per template integer (4 bits each: 28 bits, a positive int32).
DTYPES_PER_ARG = 7


@lru_cache(maxsize=4096)
def dtype_template(dtypes: tuple) -> tuple:
    """The template arguments that name a kernel's input dtypes: ``("TDT0", code), ("TDT1", code), ...``, each
    code :data:`DTYPES_PER_ARG` dtypes in 4 bits (:data:`DTYPE_CODES`). One integer per seven inputs instead of
    one argument per input: MLX formats every template argument into the kernel's name and source on every
    call, so fewer arguments cost less host time per launch. The sources never read these names.

    :raises TypeError: a dtype without a code."""
    unknown = [d for d in dtypes if d not in DTYPE_CODES]
    if unknown:
        raise TypeError(f"kernel inputs must have one of the dtypes {sorted(map(str, DTYPE_CODES))}; got {unknown[0]}")
    args = []
    for start in range(0, len(dtypes), DTYPES_PER_ARG):
        code = 0
        for i, dtype in enumerate(dtypes[start:start + DTYPES_PER_ARG]):
            code |= DTYPE_CODES[dtype] << (4 * i)
        args.append((f"TDT{start // DTYPES_PER_ARG}", code))
    return tuple(args)


@lru_cache(maxsize=None)
def kernel(name: str, backend: str, input_names: tuple[str, ...], output_names: tuple[str, ...], source: str,
           header: str = "", ensure_row_contiguous: bool = True) -> Kernel:
    """The :class:`Kernel` for this source on ``backend``, built once per process.

    :raises ValueError: ``backend`` not one of :data:`BACKENDS`.
    """
    return Kernel(name, backend, input_names, output_names, source, header, ensure_row_contiguous)
