"""Every Metal kernel source the installed packages build parses, on a machine without Metal (CI).

The kernels' Metal build is only compiled on a Mac, so a typo in a kernel file or in the dialect's Metal prelude
would first show there. This test drives every registered Metal kernel implementation through its ops (and
kvq_metal's launchers) with ``mx.fast.metal_kernel`` stubbed, writes for each launch exactly the text MLX would
compile (:func:`mlx_metal_source`, a port of ``write_signature`` and the instantiation in MLX's
``mlx/backend/common/metal_kernel.cpp``, v0.32), with ``tests/metal_shim/metal_shim.h`` standing in for the Metal
standard library and MLX's ``utils.h``, and parses it with ``clang++ -fsyntax-only -std=c++17 -x c++``. It also
checks that every kernel template built for Metal was launched, so a new kernel is covered or the test says so.
"""

from __future__ import annotations

import hashlib
import pathlib
import os
import re
import shutil
import subprocess
import tempfile

import mlx.core as mx
import pytest

import kvq
import kvq_metal
from kvq_metal import attend, dialect, kernel_files

CLANG = shutil.which("clang++")
SHIM = pathlib.Path(__file__).parent / "metal_shim"

if CLANG is None and os.environ.get("CI"):  # CI must check, not skip: .ci/run installs Debian's clang
    raise RuntimeError("tests/test_metal_syntax.py: clang++ is not on PATH under CI; .ci/run installs Debian's "
                       "clang (apt-get install clang)")
pytestmark = pytest.mark.skipif(CLANG is None, reason="clang++ is not on PATH (.ci/run installs Debian's clang)")

#: MLX's names of dtypes in generated sources (``get_type_string`` in ``mlx/backend/common/compiled.cpp``).
TYPE_STRINGS = {mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.float64: "double",
                mx.complex64: "complex64_t", mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t",
                mx.int32: "int32_t", mx.int64: "int64_t", mx.uint8: "uint8_t", mx.uint16: "uint16_t",
                mx.uint32: "uint32_t", mx.uint64: "uint64_t"}
#: The thread attributes MLX passes when their name appears in the body, in its order (``metal_kernel``).
ATTRIBUTES = [("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
              ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
              ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
              ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
              ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"),
              ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
              ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
              ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"),
              ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"), ("threads_per_threadgroup", "uint3")]
#: Inputs with fewer elements are passed in the constant address space (MLX's ``max_constant_array_size``).
MAX_CONSTANT_ARRAY_SIZE = 8


def _template_arg(value) -> tuple[str, str]:
    """(parameter kind, value text) of a template argument, as MLX's Python binding and ``write_template`` make
    them (bool before int; a bool is written 1 or 0)."""
    if isinstance(value, bool):
        return "bool", str(int(value))
    if isinstance(value, int):
        return "int", str(value)
    return "typename", TYPE_STRINGS[value]


def mlx_metal_source(spec: dict, inputs: list, template: list, output_dtypes: list) -> tuple[str, str]:
    """``(kernel name, source)`` that ``mx.fast.metal_kernel(**spec)`` compiles for a call with these ``inputs``
    (arrays), ``template`` and ``output_dtypes``; the source without MLX's ``utils()`` prefix."""
    source, header = spec["source"], spec.get("header", "")
    args = [(name, *_template_arg(value)) for name, value in template]
    template_def = "<" + ", ".join(text for _, _, text in args) + ">" if args else ""
    name = "custom_kernel_" + spec["name"]
    if args:
        name += "_" + template_def.replace("<", "_").replace(">", "_").replace(", ", "_")[:-1]
    for a in inputs:
        name += "_" + TYPE_STRINGS[a.dtype] + ("s" if a.ndim == 0 else "c" if a.size < MAX_CONSTANT_ARRAY_SIZE else "")
    name += "".join("_" + TYPE_STRINGS[d] for d in output_dtypes)
    text = header
    if args:
        text += "template <" + ", ".join(f"{kind} {n}" for n, kind, _ in args) + ">\n"
    text += f"[[kernel]] void {name}(\n"
    index = 0
    for n, a in zip(spec["input_names"], inputs):
        place = "constant" if a.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        text += f"  const {place} {TYPE_STRINGS[a.dtype]}{'&' if a.ndim == 0 else '*'} {n} [[buffer({index})]],\n"
        index += 1
        for suffix, typ in (("_shape", "int*"), ("_strides", "int64_t*"), ("_ndim", "int&")):
            if a.ndim > 0 and n + suffix in source:
                text += f"  const constant {typ} {n}{suffix} [[buffer({index})]],\n"
                index += 1
    attributes = [f"  {typ} {attr} [[{attr}]]" for attr, typ in ATTRIBUTES if attr in source]
    for n, d in zip(spec["output_names"], output_dtypes):
        # MLX's test (it compares a buffer index with a count of arrays)
        last = not (index < len(inputs) + len(output_dtypes) - 1 or attributes)
        text += f"  device {TYPE_STRINGS[d]}* {n} [[buffer({index})]]" + (") {\n" if last else ",\n")
        index += 1
    if attributes:
        text += ",\n".join(attributes) + ") {\n"
    text += source + "\n}\n"
    if args:
        text += (f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({name}{template_def}) '
                 f"{name}{template_def};\n")
    return name, text


class _Capture:
    """Stands in for an MLX Metal kernel object: keeps each call's generated source, returns zero-filled outputs."""

    def __init__(self, sources: dict, **spec) -> None:
        self.sources, self.spec = sources, spec

    def __call__(self, *, inputs, template=(), grid, threadgroup, output_shapes, output_dtypes, **kwargs):
        name, text = mlx_metal_source(self.spec, inputs, list(template), output_dtypes)
        self.sources[name] = (self.spec["name"], text)
        return [mx.zeros(tuple(s), dtype=d) for s, d in zip(output_shapes, output_dtypes)]


def _drive(impl, pure, method: str) -> None:
    """Every op of one Metal implementation on a few shapes and dtypes (default parameters)."""
    params, shapes = kvq.make_params(method), ((64, 2, 1), (128, 2, 2), (96, 8, 1))
    if kvq.registry().method(method).needs_calibration:  # vecinfer: a synthetic calibration (head_dim 64, 2 heads)
        from test_vecinfer import _calibrated

        _, params, value_params = _calibrated(code_bits=8)
        params, value_params = params.for_layer(0), value_params.for_layer(0)
        shapes = ((64, 2, 1), (64, 2, 2))
    for dtype in (mx.float16, mx.bfloat16, mx.float32):
        for D, hkv, tq in shapes:
            try:
                params.check_head_dim(D)
            except ValueError:
                continue  # a head_dim this method does not take
            x = mx.random.normal((2, 1, hkv, 300, D), key=mx.random.key(D)).astype(dtype)
            q = mx.random.normal((1, 8, tq, D), key=mx.random.key(1)).astype(dtype)
            keys = pure.kvq_quantize(x[0], params)
            values = pure.kvq_quantize(x[1], value_params if method == "vecinfer" else params)
            if kvq.registry().method(method).keys_only:  # qjl: values of another method (its kernel reads affine)
                affine = kvq.make_params("affine", bits=4).for_head_dim(D)
                values = kvq.registry().implementations[("affine", "mlx")].kvq_quantize(x[1], affine)
            if hasattr(impl, "kvq_quantize"):
                impl.kvq_quantize(x[0], params)
            if hasattr(impl, "kvq_dequantize"):
                impl.kvq_dequantize(keys, dtype)
            if hasattr(impl, "kvq_attend"):
                impl.kvq_attend(q, keys, values, D**-0.5, None)


def _affine_decode(pure) -> None:
    """affine's decode into a prefill chunk's columns (:func:`kvq_metal.baselines.affine.dequantize_into`), which
    its implementation's hook launches only on its own device: launched directly, a few widths and dtypes."""
    from kvq_metal.baselines import affine

    for dtype in (mx.float16, mx.bfloat16, mx.float32):
        for D, bits in ((64, 4), (128, 3), (256, 8)):
            x = mx.random.normal((1, 2, 40, D), key=mx.random.key(D)).astype(mx.float16)
            encoded = pure.kvq_quantize(x, kvq.make_params("affine", bits=bits).for_head_dim(D))
            affine.dequantize_into(encoded, dtype, 4, 3, "metal")


@pytest.fixture(scope="module")
def metal_sources():
    """``{MLX kernel name: (kvq kernel name, source)}`` of every Metal kernel launch of the sweep."""
    from kvq.plugins import registry

    sources: dict = {}
    reg = registry()
    patch = pytest.MonkeyPatch()
    patch.setattr(mx.fast, "metal_kernel", lambda **spec: _Capture(sources, **spec))
    patch.setattr(kvq_metal.base, "first_use_check", lambda *a, **k: True)
    patch.setenv("KVQ_DATA_DIR", tempfile.mkdtemp(prefix="kvq-metal-syntax-"))
    dialect.kernel.cache_clear()
    try:
        for (method, backend), impl in sorted(reg.implementations.items()):
            if backend == "metal":
                _drive(impl, reg.implementations[(method, "mlx")], method)
        attend._zero_counters(8, "metal")  # launched on CUDA's tensor-core path only, but written in the dialect
        _affine_decode(reg.implementations[("affine", "mlx")])
    finally:
        dialect.kernel.cache_clear()
        patch.undo()
    return sources


def test_every_metal_template_is_launched(metal_sources):
    metal = {"kvq_" + name for name, k in kernel_files.templates().items() if "metal" in k.backends}
    built = {kvq_name.rsplit("_", 1)[0] for kvq_name, _ in metal_sources.values()}  # kvq_<name>_<hash>
    assert metal <= built, f"Metal templates that no launch of the sweep built: {sorted(metal - built)}"


def as_cpp(text: str) -> str:
    """``text`` as C++: Metal takes attributes on an explicit template instantiation (MLX's last line), C++ does
    not; they are dropped (only there: the instantiation is still checked)."""
    cpp, n = re.subn(r'^template \[\[host_name\("\w+"\)\]\] \[\[kernel\]\] decltype', "template decltype", text,
                     flags=re.MULTILINE)
    assert n <= 1
    return '#include "metal_shim.h"\n' + cpp


def test_generated_metal_sources_parse(metal_sources, tmp_path):
    """Each distinct generated source (kernel, template values, dtypes) parses; clang's errors name the kernel."""
    assert metal_sources
    failures = []
    for name, (_, text) in sorted(metal_sources.items()):
        # MLX names a launch by its template values and dtypes: long names are shortened to a hash for the file
        stem = name if len(name) < 200 else name[:100] + "_" + hashlib.sha256(name.encode()).hexdigest()[:16]
        path = tmp_path / f"{stem}.metal.cpp"
        path.write_text(as_cpp(text))
        run = subprocess.run([CLANG, "-fsyntax-only", "-std=c++17", "-x", "c++", "-Wno-unknown-attributes",
                              "-ferror-limit=5", "-I", str(SHIM), str(path)], capture_output=True, text=True)
        if run.returncode:
            failures.append(f"{name}:\n{run.stderr[-3000:]}")
    assert not failures, "\n".join(failures)


def test_generated_source_matches_mlx_format():
    """The port writes MLX's form: header, template parameters, the signature with buffers, shapes and strides
    for the inputs whose names the body uses, the thread attributes it names, and the explicit instantiation."""
    spec = {"name": "k", "input_names": ["a", "s"], "output_names": ["out"], "header": "// h\n",
            "source": "out[thread_position_in_grid.x] = a[a_strides[0]] * s;"}
    name, text = mlx_metal_source(spec, [mx.zeros((16,), mx.float16), mx.array(2.0)], [("N", 4), ("F", True),
                                                                                       ("T", mx.float32)],
                                  [mx.float32])
    assert name == "custom_kernel_k__4_1_float_float16_t_floats_float"
    assert text == (
        "// h\ntemplate <int N, bool F, typename T>\n"
        f"[[kernel]] void {name}(\n"
        "  const device float16_t* a [[buffer(0)]],\n"
        "  const constant int64_t* a_strides [[buffer(1)]],\n"
        "  const constant float& s [[buffer(2)]],\n"
        "  device float* out [[buffer(3)]],\n"
        "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {\n"
        "out[thread_position_in_grid.x] = a[a_strides[0]] * s;\n}\n"
        f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({name}<4, 1, float>) {name}<4, 1, float>;\n')
