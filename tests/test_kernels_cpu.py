"""kvq_metal on a machine without a GPU (CI): nothing but pure MLX is selected, and the kernel dialect translates
to both back ends (the CUDA build is exercised by tests/test_kernels_gpu.py on an H200)."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import given, settings, strategies as st

import kvq
import kvq_metal
from kvq_metal import dialect, kernel_files

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="CPU-only behaviour")

TOKENS = ("KVQ_TG_X", "KVQ_TG_Y", "KVQ_TID", "KVQ_GID", "KVQ_LANE", "KVQ_WARP", "KVQ_SHARED", "KVQ_BARRIER()")


@pytest.mark.parametrize("method", ["affine", "turboquant", "turboquant_rvq"])
def test_cpu_selection_picks_pure_mlx(method):
    for T in (16, 4096, 131072):
        plan = kvq.select(method, (1, 8, T, 128), num_q_heads=32)
        assert {c.backend for c in plan.choices.values()} == {"mlx"}, plan.explain()
        assert "cuda kernel, not for cpu" in plan.explain()


def test_kernels_are_registered_for_both_back_ends_but_offer_nothing_here():
    impls = kvq.plugins.registry().implementations
    for method in ("affine", "turboquant", "turboquant_rvq", "turboquant_prod", "qjl", "vecinfer"):
        for backend in ("metal", "cuda"):
            assert not impls[(method, backend)].live()
    assert kvq_metal.gpu_backend() is None


@pytest.mark.parametrize("name", sorted(kernel_files.templates()))
@pytest.mark.parametrize("backend", dialect.BACKENDS)
def test_dialect_translates_every_token(name, backend):
    if backend not in kvq_metal.TEMPLATE_BACKENDS.get(name, dialect.BACKENDS):
        pytest.skip(f"{name} is built for {kvq_metal.TEMPLATE_BACKENDS[name]} only")
    body = dialect.translate(kvq_metal.TEMPLATES[name], backend)
    assert not any(t in body for t in TOKENS)
    # every KVQ_ name left is a prelude macro of this back end (or one the template defines)
    left = set(re.findall(r"\bKVQ_[A-Z0-9_]+", body))
    defined = set(re.findall(r"#define (KVQ_[A-Z0-9_]+)", dialect.PRELUDES[backend] + body))
    assert left <= defined, left - defined
    if backend == "metal":
        assert "_position_in_grid" in body and not re.search(r"__syncthreads|blockIdx|threadIdx", body)
    else:
        assert "blockIdx" in body and not re.search(r"threadgroup_barrier|_position_in_grid", body)


@pytest.mark.parametrize("name", sorted(kernel_files.templates()))
def test_every_kernel_file_names_its_reference_and_launcher(name):
    """Each kernel file's preamble names its pure-MLX reference and its launcher, and both exist."""
    import pkgutil

    source = kernel_files.LOADED[name]
    for dotted in (source.reference, source.launcher):
        assert dotted, f"{source.path}: the preamble needs '// Reference:' and '// Launcher:' lines"
        assert callable(pkgutil.resolve_name(dotted)), dotted


def test_every_other_kernel_folder_file_names_the_kernels_that_use_it():
    """Every file of a kernel folder is a loaded kernel (the test above resolves its Reference: and Launcher:) or a
    shared fragment or header whose preamble has one ``// Used by: a.kvq, b.cu`` line naming exactly the kernel
    files (or headers, ``.cuh``) that ``#include`` it, or, for a header, the kernel built with it."""
    loaded = {Path(s.path).resolve(): s for s in kernel_files.templates().values()}
    folders = {kernel_files.KERNELS.resolve(), *(path.parent for path in loaded)}
    files = sorted(p.resolve() for d in folders for p in d.iterdir() if p.suffix in (".kvq", ".cu", ".cuh"))
    for path in files:
        preamble = kernel_files._split_preamble(path.read_text())[0]
        used = [line.split(":", 1)[1] for line in preamble if line.startswith("// Used by:")]
        if path in loaded:
            assert not used, f"{path.name} is a kernel: its preamble names Reference: and Launcher:, not Used by:"
            continue
        assert len(used) == 1, f"{path.name}: a fragment or header needs one '// Used by:' line"
        if path.suffix == ".cuh":
            users = {k.name for k, s in loaded.items() if s.header and s.header == kernel_files._expand(path)[1]}
        else:
            users = {f.name for f in files if f'#include "{path.name}"' in f.read_text()}
        assert set(re.findall(r"\b\w+\.(?:kvq|cuh|cu)\b", used[0])) == users and users, (path.name, users)


def test_kernel_files_drop_preambles_and_expand_includes(tmp_path):
    """A kernel file's leading ``//`` lines are documentation, not text; ``#include "name"`` lines are replaced by
    the named file (beside it, or one of kvq_metal's shared fragments); cycles and missing files are errors."""
    (tmp_path / "part.kvq").write_text("// a fragment\n    int y = 2;\n")
    (tmp_path / "k.kvq").write_text("// k: a kernel\n// Reference: mlx.core.zeros\n// Launcher: x.y\n\n"
                                    '    int x = 1;\n#include "part.kvq"\n  #include "split_index.kvq"\n    // kept\n')
    source = kernel_files.read(tmp_path / "k.kvq")
    split = kernel_files._split_preamble((kernel_files.KERNELS / "split_index.kvq").read_text())[1]
    assert source.source == "\n    int x = 1;\n    int y = 2;\n" + split + "    // kept\n"
    assert (source.name, source.reference, source.launcher, source.backends) == ("k", "mlx.core.zeros", "x.y",
                                                                               dialect.BACKENDS)
    assert "k" not in kernel_files.LOADED  # read() registers nothing
    (tmp_path / "c.cu").write_text('#include "c.cu"\n')
    with pytest.raises(ValueError, match="includes itself: c.cu -> c.cu"):
        kernel_files.read(tmp_path / "c.cu")
    (tmp_path / "m.cu").write_text('#include "missing.kvq"\n')
    with pytest.raises(FileNotFoundError, match="included file 'missing.kvq'"):
        kernel_files.read(tmp_path / "m.cu")


def test_kvq_metal_knows_no_method_plugin():
    """kvq_metal imports no method's plugin (kvq core <- kvq_metal <- plugins) and works without one."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(kvq_metal.__file__).parent
    imports = re.compile(r"^\s*(from|import)\s+kvq_backends_|import_module\([^)]*kvq_backends_", re.MULTILINE)
    assert not [str(p.relative_to(root)) for p in root.rglob("*.py") if imports.search(p.read_text())]
    code = ("import sys; sys.modules['kvq_backends_turboquant'] = None; import kvq_metal; "
            "print(sorted({i.method for i in kvq_metal.implementations()}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['affine']"


@pytest.mark.parametrize("method", ["affine", "turboquant", "turboquant_rvq"])
def test_reference_attend_agrees_with_each_methods_pure_mlx(method):
    """:func:`kvq_metal.reference.decode_attend` (the decode-attention kernels' pure-MLX reference, over Sides)
    gives each method's pure-MLX attention: the Side description (``table[code] * scale + bias``, rotated by
    ``signs``) is the whole contract between a method and the kernels."""
    from kvq.plugins import registry
    from kvq_backends_turboquant import rotation
    from kvq_backends_turboquant.kernels import turboquant, turboquant_rvq
    from kvq_metal import reference
    from kvq_metal.baselines import affine
    from kvq_metal.common import relative_error

    kw, side, D = {"affine": ({"bits": 4, "group_size": 32}, affine._side, 64),
                   "turboquant": ({"bits": 3}, turboquant._side, 96),
                   "turboquant_rvq": ({"bits": 2, "residual_bits": 2}, turboquant_rvq._side, 64)}[method]
    p = kvq.make_params(method, **kw)
    pure = registry().implementations[(method, "mlx")]
    x = mx.random.normal((2, 1, 2, 100, D), key=mx.random.key(1)).astype(mx.float16)
    keys, values = pure.kvq_quantize(x[0], p), pure.kvq_quantize(x[1], p)
    q = mx.random.normal((1, 8, 1, D), key=mx.random.key(2)).astype(mx.float16)
    want, want_lse = pure.kvq_attend(q, keys, values, D**-0.5, None)
    signs = None if method == "affine" else rotation.rotation("hadamard", p.rotated_dim(D), p.seed).signs
    got, lse = reference.decode_attend(q, D**-0.5, side(keys), side(values), signs=signs, out_dim=D)
    assert got.shape == want.shape and relative_error(got, want) < 1e-5
    assert mx.max(mx.abs(lse - want_lse)).item() < 1e-5


def test_translate_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of metal, cuda; got 'vulkan'"):
        dialect.translate("KVQ_TID", "vulkan")


def test_sources_hash_is_stable_and_covers_the_templates():
    h = kvq_metal.sources_hash()
    assert re.fullmatch(r"[0-9a-f]{16}", h) and h == kvq_metal.sources_hash()
    assert kernel_files.sources_hash([kvq_metal.TEMPLATES["decode_attend"] + " "]) != h


def test_decode_attend_limits():
    from kvq_metal import attend

    assert attend.supported(128, 4, 4, 128, 128, 4)
    assert attend.supported(128, 8, 8, 32, 32, 8)
    assert not attend.supported(128, 4, 4, 128, 128, 9)  # more query rows than one thread group serves
    assert not attend.supported(96, 4, 4, 96, 96, 1)  # 12 threads per token: not a power of two
    assert not attend.supported(512, 4, 4, 512, 512, 1)  # 64 threads per token


@settings(max_examples=300, deadline=None)
@given(batch_heads=st.integers(1, 64), num_tokens=st.integers(1, 1 << 20), tile=st.sampled_from([16, 32, 64, 128]),
       groups=st.one_of(st.none(), st.integers(1, 4096)))
def test_splits_cover_every_token_once_and_none_is_empty(batch_heads, num_tokens, tile, groups):
    """The kernels take the split count from the grid and compute each split's length (``dialect.SPLIT_INDEX``,
    mirrored by ``split_chunk``): the splits must cover the sequence, in whole tiles, with no empty split (an
    empty one would still be launched and merged)."""
    from kvq_metal import attend

    splits = attend.splits_for(batch_heads, num_tokens, "cuda", tile, groups)
    chunk = attend.split_chunk(num_tokens, splits, tile)
    assert 1 <= splits <= attend.MAX_SPLITS and chunk % tile == 0
    assert splits * chunk >= num_tokens and (splits - 1) * chunk < num_tokens
    target = groups or attend.TARGET_GROUPS["cuda"]
    assert splits <= max(1, -(-target // batch_heads))


def test_tensor_core_attend_limits():
    """The tensor-core kernel (CUDA) serves what the issue's shapes need and refuses what its fragments cannot
    hold; the SIMT kernel serves the rest and Metal."""
    from kvq_metal import attend, attend_tc

    assert attend_tc.supported(128, 4, 4, 128, 128, 4)  # turboquant-4, GQA 4 (the decode shape)
    assert attend_tc.supported(128, 3, 3, 128, 128, 8)
    assert attend_tc.supported(128, 4, 4, 64, 64, 4)  # affine-4, group 64: one group per thread slice
    assert attend_tc.supported(128, 8, 8, 32, 32, 8)  # affine-8, group 32: one key slice holds one group
    assert attend_tc.supported(64, 2, 2, 64, 64, 2, 1, 1)  # turboquant_rvq (2, 1)
    assert attend_tc.supported(256, 4, 4, 256, 256, 8)
    assert not attend_tc.supported(128, 4, 4, 128, 128, 9)  # more rows than one mma N tile
    assert attend_tc.supported(96, 3, 3, 96, 96, 4)  # 24 + 12 coordinates per slice: unaligned slices are shifted
    assert not attend_tc.supported(512, 4, 4, 512, 512, 1)  # head_dim over 256
    assert attend_tc.supported(128, 4, 4, 8, 8, 4)  # groups of 8: several per slice, scales per pair
    assert not attend_tc.supported(192, 4, 4, 64, 64, 4)  # 48-coordinate key slices straddle groups of 64
    assert not attend_tc.supported(128, 4, 4, 128, 128, 4, 4, 5)  # 9 bits per value code: table over 256
    side = attend.Side(None, None, None, None, 4, 128)
    assert attend.uses_tensor_cores("cuda", 128, side, side, 4)
    assert not attend.uses_tensor_cores("metal", 128, side, side, 4)


def test_decode_kernels_take_flat_offsets_and_the_softmax_slack_from_their_knobs():
    """``AttendKnobs.flat32`` / ``slack`` reach the tensor-core decode kernel's template (``FLAT32``, ``SLACK``;
    the streams kernel's: tests/test_streams.py); a slack outside 0..8 (or not an integer) is refused by name."""
    import attrs

    from kvq_metal import attend_tc, knobs

    common = (("D", 128), ("R", 4), ("KB", 3), ("VB", 3), ("KG", 128), ("VG", 128), ("THREADS", 128))
    layout = (True, True, True)
    default = dict(attend_tc.launch_template(common, 2, 128, layout, knobs.AttendKnobs(), True, 1)[0])
    assert (default["FLAT32"], default["SLACK"]) == (True, 0)  # slack 0: value norms up to float16's maximum
    other = dict(attend_tc.launch_template(common, 2, 128, layout, knobs.AttendKnobs(flat32=False, slack=4), True,
                                           1)[0])
    assert (other["FLAT32"], other["SLACK"]) == (False, 4)
    # affine's table-free decode keeps row offsets (its registers, not its instructions, bound a wide batch)
    lin = dict(attend_tc.launch_template(common, 2, 128, layout, knobs.AttendKnobs(), True, 1, (True, True))[0])
    assert (lin["FLAT32"], lin["KLIN"]) == (False, True)
    for wrong in (-1, 9, 2.5, True, "8"):
        with pytest.raises(ValueError, match="slack must be an integer from 0 to 8"):
            attend_tc.slack(wrong)
    with pytest.raises(ValueError, match="slack"):
        attend_tc.launch_template(common, 2, 128, layout, attrs.evolve(knobs.AttendKnobs(), slack=20), True, 1)
    assert knobs.StreamsKnobs().slack == 0


@pytest.mark.parametrize("wrong", [False, True])
def test_fused_dense_call_is_checked_once_before_use(wrong):
    """``attend_dense`` runs its first-use check (the fused call against the three parts in pure MLX) once per
    key; a wrong fused call is disabled with a KernelDisabledWarning and the caller gets ``None`` (parts)."""
    import mlx.core as mx

    import kvq
    from kvq.attention import DenseTokens, dense_attend, merge_parts
    from kvq_metal.base import CHECKS, KernelDisabledWarning, KernelImpl

    calls = []

    class FakeDense(KernelImpl):
        method = "affine"

        def _attend_dense(self, queries, keys, values, scale, dense):
            calls.append(keys.num_tokens)
            pure = self.fallback()
            out, lse = merge_parts([pure.kvq_attend(queries, keys, values, scale, None),
                                    dense_attend(queries, dense.sink_keys, dense.sink_values, scale),
                                    dense_attend(queries, dense.window_keys, dense.window_values, scale)])
            return (out * 1.01 if wrong else out), lse

    impl = FakeDense("cuda")
    p = kvq.make_params("affine", bits=4, group_size=32)
    pure = impl.fallback()
    x = mx.random.normal((1, 2, 50, 64), key=mx.random.key(7)).astype(mx.float16)
    keys, values = pure.kvq_quantize(x, p), pure.kvq_quantize(x * 0.5, p)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(8)).astype(mx.float16)
    dense = DenseTokens(x[:, :, :4], x[:, :, :4], x[:, :, -8:], x[:, :, -8:])
    saved = dict(CHECKS)
    CHECKS.clear()
    try:
        if wrong:
            with pytest.warns(KernelDisabledWarning, match="decode_attend_dense"):
                assert impl.attend_dense(q, keys, values, 0.125, dense) is None
        else:
            assert impl.attend_dense(q, keys, values, 0.125, dense) is not None
            assert impl.attend_dense(q, keys, values, 0.125, dense) is not None
        assert calls[0] == 300  # the check's own problem, once; then the real calls (none after a failure)
        assert calls[1:] == ([] if wrong else [50, 50])
    finally:
        CHECKS.clear()
        CHECKS.update(saved)


def test_table_layout_copies_tables_per_lane_within_static_shared_memory():
    """The tensor-core kernel's table layout (kvq_metal.attend.table_layout): a 4-bit pair table (256 entries) per
    lane takes 32 KB, so keys and values sharing one codebook both get copies; two different 4-bit tables at
    head_dim 256 with 8 query rows leave room for the keys' copies only; ``TUNING.rep`` off keeps one copy."""
    import attrs
    import mlx.core as mx

    from kvq_metal import attend

    t4 = mx.zeros((16,), mx.float32)
    t3 = mx.zeros((8,), mx.float32)
    side = lambda table, bits, group=128: attend.Side(None, None, None, table, bits, group)  # noqa: E731
    assert attend.table_layout(128, 4, side(t4, 4), side(t4, 4)) == (True, True, True)
    assert attend.table_layout(128, 4, side(t4, 4), side(t3, 3)) == (True, True, False)
    other = mx.zeros((16,), mx.float32)
    assert attend.table_layout(256, 8, side(t4, 4, 256), side(other, 4, 256)) == (True, False, False)
    grouped = attend.Side(None, None, t4, t4, 4, 64)  # affine: per-group scales and biases
    assert attend.table_layout(128, 4, grouped, grouped) == (True, True, True)
    saved = attend.TUNING
    attend.TUNING = attrs.evolve(saved, rep=False)
    try:
        assert attend.table_layout(128, 4, side(t4, 4), side(t4, 4)) == (False, False, True)
    finally:
        attend.TUNING = saved


def test_affine_4_bit_sides_are_decoded_without_tables():
    """4-bit integer levels with group scales and biases (``affine``) take the tensor-core kernel's arithmetic
    decode (template ``KLIN`` / ``VLIN``, no table copies, no shared table) where a side's slice is whole words:
    keys at head_dim >= 32, values at >= 64, groups of whole words; other widths, codebooks (turboquant's centroids)
    and the knob off keep the tables. The plan is pure Python, so it is checked here for the CUDA back end."""
    import attrs

    from kvq_metal import attend

    levels = mx.arange(16, dtype=mx.float32)

    def plan(D, bits=4, keys_levels=True, values_levels=True, group=64, biases=True):
        table = levels if bits == 4 else mx.arange(1 << bits, dtype=mx.float32)
        def side(lv):
            return attend.Side(mx.zeros((1, 8, 64, D * bits // 32), mx.uint32), None, table if biases else None,
                               table, bits, min(group, D), levels=lv)
        keys, values = side(keys_levels), side(values_levels)
        p, *_ = attend._plan_for((1, 32, 1, D), D ** -0.5, keys, values, "cuda", False, None, None)
        t = dict(p.template)
        return t["KLIN"], t["VLIN"], t["KREP"], t["VREP"], t["VSAME"]

    assert plan(128) == (True, True, False, False, False)
    assert plan(64) == (True, True, False, False, False)
    assert plan(256, group=128) == (True, True, False, False, False)
    assert plan(32) == (True, False, False, True, False)  # values: 4 coordinates per slice, half a word
    assert plan(128, keys_levels=False) == (False, True, True, False, False)  # a codebook: its table, copied
    assert plan(128, bits=8)[:2] == (False, False)
    assert plan(128, bits=2)[:2] == (False, False)
    assert plan(128, group=128, biases=False)[:2] == (False, False)  # one scale per vector: applied to scores
    saved = attend.TUNING
    attend.TUNING = attrs.evolve(saved, lin=False)
    try:
        assert plan(128) == (False, False, True, True, True)
        attend.TUNING = attrs.evolve(saved, cpt=4)  # groups of 4 served (4 coordinates per SIMT thread)
        assert plan(128, group=4)[:2] == (False, False)  # a pair (coordinates k, k + 4) would straddle two groups
    finally:
        attend.TUNING = saved


def test_wide_bound_steps_of_table_sides_get_the_wide_launch_bound():
    """A bound step whose rows alone fill the split target (``B * H_kv >= tc_groups``: a large batch) is built with
    ``__launch_bounds__(THREADS, minb_wide)`` where both sides decode through tables at head_dim <= 128; a narrower
    batch, a side decoded without a table (affine's 4-bit levels), head_dim 256 and ``minb_wide`` 0 keep ``minb``. The plan is pure Python, so
    it is checked here for the CUDA back end."""
    import attrs

    from kvq_metal import attend

    H = 8
    centroids = mx.array([-1.5, -0.5, 0.5, 1.5], mx.float32)
    levels = mx.arange(16, dtype=mx.float32)

    def minb(B, affine=False, D=128):
        if affine:
            side = attend.Side(mx.zeros((B, H, 64, D * 4 // 32), mx.uint32), None, levels, levels, 4, 64,
                               levels=True)
        else:
            side = attend.Side(mx.zeros((B, H, 64, D * 2 // 32), mx.uint32), None, mx.ones((B, H, 64, 1)),
                               centroids, 2, D)
        p, *_ = attend._plan_for((B, 4 * H, 1, D), D ** -0.5, side, side, "cuda", False, None, None)
        return dict(p.template)["MINB"]

    rows_to_fill = -(-attend.TUNING.tc_groups // H)  # sequences whose B * H reach the target
    assert attend.TUNING.minb == 0 and attend.TUNING.minb_wide == 4
    assert minb(1) == 0
    assert minb(rows_to_fill - 1) == 0
    assert minb(rows_to_fill) == 4
    assert minb(rows_to_fill, affine=True) == 0  # no tables: the bound did not pay (knobs.AttendKnobs)
    assert minb(rows_to_fill, D=256) == 0  # 128 registers a thread would spill inside the loop
    saved = attend.TUNING
    try:
        attend.TUNING = attrs.evolve(saved, minb_wide=0, minb=3)
        assert minb(rows_to_fill) == 3 and minb(1) == 3
        attend.TUNING = attrs.evolve(saved, minb=2)
        assert minb(rows_to_fill, affine=True) == 2 and minb(rows_to_fill) == 4
    finally:
        attend.TUNING = saved


def test_linear_decode_of_4_bit_codes_gives_the_codes_exactly():
    """The arithmetic decode the tensor-core kernel runs for ``affine`` 4-bit codes (``kvq_lin4``): each nibble
    OR'd into the top mantissa bits of 16.0 (``(w << 6 .. >> 6) & 0x03c003c0 | 0x4c004c00``) is the half ``16 +
    code``, and 16 subtracted in half precision leaves the code exactly, so the group's half2 fma after it rounds
    as the table path's does. Pair ``j`` of a word holds nibbles ``j`` and ``j + 4`` (``kvq_pair_first`` with
    ``LIN``). Emulated in numpy on packed words; the kernel itself is compared with pure MLX and with its table
    path on a GPU (tests/test_kernels_gpu.py)."""
    import numpy as np

    rng = np.random.default_rng(0)
    words = rng.integers(0, 2 ** 32, size=4096, dtype=np.uint64).astype(np.uint32)
    sixteen = np.float16(16.0)
    for j in range(4):
        y = (words << np.uint32(6 - 4 * j)) if j < 2 else (words >> np.uint32(4 * j - 6))
        h = (y & np.uint32(0x03C003C0)) | np.uint32(0x4C004C00)
        lo = (h & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16)
        hi = (h >> np.uint32(16)).astype(np.uint16).view(np.float16)
        for half, nibble in ((lo, j), (hi, j + 4)):
            codes = (words >> np.uint32(4 * nibble)) & np.uint32(15)
            assert np.array_equal(half.astype(np.float64), 16.0 + codes)
            assert np.array_equal((half - sixteen).astype(np.float64), codes.astype(np.float64))


@pytest.mark.parametrize("wrong", [False, True])
def test_attend_check_compares_the_kernel_path_with_pure_mlx(wrong):
    """``check_attend`` (the decode-attention kernels' first-use check) passes an implementation whose kernel path
    equals pure MLX and fails one whose output is 1% off, on device-drawn data of the given dtype and rows."""
    import mlx.core as mx

    import kvq
    from kvq_metal.base import KernelImpl
    from kvq_metal.common import check_attend, normal

    class Fake(KernelImpl):
        method = "affine"

        def attend_kernel(self, queries, keys, values, scale):
            out, lse = self.fallback().kvq_attend(queries, keys, values, scale, None)
            return (out * 1.01 if wrong else out), lse

    impl = Fake("cuda")
    p = kvq.make_params("affine", bits=4, group_size=32)
    ok, message = check_attend(impl, impl.fallback().kvq_quantize, p, p, 64, 4, mx.float16)
    assert ok is (not wrong), message
    assert "relative error" in message
    a, b = normal((2, 3), 5), normal((2, 3), 5)
    assert mx.array_equal(a, b) and normal((2, 3), 5, mx.float16).dtype == mx.float16


def test_float_bits_round_trips_and_rejects_non_finite():
    """Float scalars (the softmax scale) reach the kernels as the int of their float32 bits, which the kernels
    turn back with ``KVQ_AS_FLOAT``."""
    import struct

    assert dialect.float_bits(1.0) == 0x3F800000 and dialect.float_bits(-2.0) == -0x40000000
    for value in (128 ** -0.5, 1e-30, 3.0e38):
        bits = dialect.float_bits(value)
        assert struct.unpack("<f", struct.pack("<i", bits))[0] == struct.unpack("<f", struct.pack("<f", value))[0]
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="value must be a finite float"):
            dialect.float_bits(bad)


def test_dense_tokens_of_two_dtypes_are_refused_before_any_kernel():
    """The tensor-core kernel reads a cache's sinks and window as one dtype: DenseTokens mixing dtypes get a clear
    error (checked before a kernel is built, so it holds on any machine)."""
    from kvq.attention import DenseTokens
    from kvq_metal import attend

    side = attend.Side(mx.zeros((1, 1, 8, 16), mx.uint32), mx.ones((1, 1, 8), mx.float16), None,
                       mx.zeros((16,), mx.float32), 4, 128)
    q = mx.zeros((1, 4, 1, 128), mx.float16)
    w = mx.zeros((1, 1, 3, 128), mx.float16)
    dense = DenseTokens(w.astype(mx.bfloat16), w.astype(mx.bfloat16), w, w)
    with pytest.raises(ValueError, match=r"dense sinks and window must share one dtype.*bfloat16.*float16"):
        attend.decode_attend(q, 0.1, side, side, "cuda", dense=dense)


def test_kernel_names_tell_input_dtypes_apart():
    """MLX names a compiled kernel by its template values and types each input pointer by its dtype: the packed
    dtype arguments must differ for any two dtype lists, so a float16 build never serves bfloat16 inputs."""
    import itertools

    from kvq_metal.dialect import DTYPE_CODES, dtype_template

    dtypes = list(DTYPE_CODES)
    seen = {}
    for combo in itertools.product(dtypes, repeat=2):
        for n_before in (0, 6, 13):  # the pair inside one packed integer and across two
            full = (mx.float16,) * n_before + combo
            seen.setdefault(tuple(v for _, v in dtype_template(full)), set()).add(full)
    assert all(len(group) == 1 for group in seen.values())
    assert all(0 < v < 2**31 for args in seen for v in args)  # template ints are int32
    assert dtype_template((mx.float16,) * 15)[0] == ("TDT0", sum(10 << (4 * i) for i in range(7)))
    with pytest.raises(TypeError, match="kernel inputs must have one of the dtypes"):
        dtype_template((mx.float16, "float8"))


def test_baked_source_writes_the_constexpr_lines_mlx_writes_and_the_aliases():
    """A bound CUDA launch carries its template in its text: MLX's own lines for bools and ints (so the kernel
    compiles as with template arguments), a ``#define`` per alias with its shape/strides/ndim, and a comment naming
    the shapes and strides the body reads through the aliases (MLX passes an input's shape where its name occurs)."""
    text = dialect.baked_source((("D", 128), ("ROT", True), ("KBIAS", False)), "BODY", {"kc2": "kc"},
                                ["kc_shape", "kc2_strides", "ks_strides"])
    assert text.startswith("  constexpr int D = 128;\n  constexpr bool ROT = true;\n  constexpr bool KBIAS = false;\n")
    for what in ("", "_shape", "_strides", "_ndim"):
        assert f"#define kc2{what} kc{what}\n" in text
    assert "// reads kc_shape kc_strides ks_strides\n" in text and text.endswith("\nBODY")
    assert dialect.baked_source((), "BODY") == "\nBODY"
    with pytest.raises(TypeError, match="SCALE is 0.5"):
        dialect.baked_source((("SCALE", 0.5),), "BODY")


def test_bound_cuda_kernel_drops_aliased_inputs_and_template_arguments(monkeypatch):
    """:meth:`Kernel.bound` on CUDA: a kernel object per template, dtypes and aliases, named apart, built once;
    its launches take no template arguments and only the kept inputs; bad aliases are refused."""
    built = []

    def fake_cuda_kernel(**kw):
        built.append(kw)
        return lambda **call: None

    monkeypatch.setattr(mx.fast, "cuda_kernel", fake_cuda_kernel)
    monkeypatch.setattr(dialect, "includes_work", lambda: False)
    kern = dialect.Kernel("probe", "cuda", ("q", "kc", "kc2", "out_len"), ("out",),
                          "out[0] = q[0] + kc[kc_shape[0]] + kc2[kc2_strides[0]];", "", True)
    q, codes = mx.zeros((2,), mx.float16), mx.zeros((3,), mx.uint32)
    call, template, kept = kern.bound([("D", 64)], [q, codes, codes, q], {"kc2": "kc"})
    assert template == [] and kept == (0, 1, 3)
    assert built[-1]["input_names"] == ["q", "kc", "out_len"] and built[-1]["name"].startswith(kern.name + "_b")
    source = built[-1]["source"]
    assert "constexpr int D = 64;" in source and "#define kc2 kc\n" in source and "kc_strides" in source
    assert "constexpr int TDT0" in source  # the kept inputs' dtypes name the kernel
    again, _, _ = kern.bound([("D", 64)], [q, codes, codes, q], {"kc2": "kc"})
    assert again is call and len(built) == 2  # the kernel object of __init__, and one bound one
    kern.bound([("D", 64)], [q.astype(mx.bfloat16), codes, codes, q], {"kc2": "kc"})
    assert len(built) == 3 and built[-1]["name"] != built[-2]["name"]
    for wrong in ({"kc3": "kc"}, {"kc2": "kc", "kc": "q"}):
        with pytest.raises(ValueError, match="aliases must map inputs of"):
            kern.bound([("D", 64)], [q, codes, codes, q], wrong)
    metal = dialect.Kernel.__new__(dialect.Kernel)  # elsewhere: MLX's kernel object, every input, the template
    metal.backend, metal.input_names, metal._kernel, metal.name = "metal", ("q", "kc"), object(), "m"
    call, template, kept = metal.bound([("D", 64)], [q, codes], {})
    assert call is metal._kernel and kept == (0, 1) and template[0] == ("D", 64) and template[1][0] == "TDT0"


def test_decode_step_inputs_pass_each_array_once():
    """The decode step's aliases (:func:`kvq_metal.step.aliases`, one rule for both families): repeated code
    inputs (a side without a second code stream or biases passes its codes and scales twice) and, without sinks,
    the sink inputs (the window stands in: :func:`kvq_metal.step.dense_inputs`); never an input a step passes
    anew each call."""
    from kvq_metal.attend import TC_INPUTS
    from kvq_metal.step import aliases, dense_inputs

    a, b, c = mx.zeros((1,)), mx.zeros((1,)), mx.zeros((1,))
    arrays = {n: mx.zeros((1,)) for n in TC_INPUTS}
    arrays.update(kc=a, kc2=a, ks=b, kb=b, vc=c, vc2=c, vs=b, vb=b)
    inputs = [arrays[n] for n in TC_INPUTS]
    assert aliases(TC_INPUTS, inputs) == {"kc2": "kc", "kb": "ks", "vc2": "vc", "vs": "ks", "vb": "ks"}
    wk, wv = arrays["wk"], arrays["wv"]
    inputs[-5:-1] = dense_inputs(wk, wv, None, None)
    assert aliases(TC_INPUTS, inputs)["sk"] == "wk" and aliases(TC_INPUTS, inputs)["sv"] == "wv"
    inputs[-4] = wk  # the same array as the window's keys: a step still passes its values
    assert "wv" in aliases(TC_INPUTS, inputs) and "wv" not in aliases(TC_INPUTS, inputs, per_step=("wk", "wv"))


@pytest.fixture
def cuda_launches(monkeypatch):
    """MLX's CUDA kernel builder stood in with one that records each launch and returns zeros of the asked shapes
    (what a launcher builds can be checked on a machine without a GPU); kernel objects built before or during the
    test are forgotten, so none records into another test's list."""
    launches = []

    def fake_cuda_kernel(**build):
        def launch(**call):
            launches.append(dict(build, **call))
            return [mx.zeros(s, d) for s, d in zip(call["output_shapes"], call["output_dtypes"])]
        return launch

    monkeypatch.setattr(mx.fast, "cuda_kernel", fake_cuda_kernel)
    monkeypatch.setattr(dialect, "includes_work", lambda: False)
    dialect.kernel.cache_clear()
    yield launches
    dialect.kernel.cache_clear()


@pytest.mark.parametrize("method,overrides,D", [("qjl", {}, 128), ("qjl", {"outlier_channels": 0}, 64),
                                               ("qjl", {"sketch_dim": 96, "outlier_channels": 8}, 256),
                                               ("turboquant_prod", {"bits": 4}, 128),
                                               ("turboquant_prod", {"bits": 2}, 120)])
def test_fused_encoders_launch_one_kernel_with_the_pure_mlx_fields(method, overrides, D, cuda_launches):
    """The fused encoders of qjl and turboquant_prod (issue #21) launch one kernel and return an Encoded with the
    fields, shapes and dtypes of the pure-MLX encoder, for 77 tokens (two groups of 32 and a part), so a cache's
    store takes their blocks after pure MLX's."""
    launches = cuda_launches
    impl = kvq.registry().implementations[(method, "cuda")]
    pure = kvq.registry().implementations[(method, "mlx")]
    params = kvq.make_params(method, **overrides)
    x = mx.random.normal((2, 3, 77, D)).astype(mx.bfloat16)
    got, want = impl.kvq_quantize(x, params), pure.kvq_quantize(x, params)
    assert len(launches) == 1
    assert {k: (v.shape, v.dtype) for k, v in got.data.items()} == {k: (v.shape, v.dtype) for k, v in want.data.items()}
    assert got.head_dim == want.head_dim and got.params == want.params
    grid, group = launches[0]["grid"], launches[0]["threadgroup"]
    if method == "qjl":  # a thread group per (row, group of 32 tokens, 4 tokens of it)
        assert (grid[0] // group[0], grid[1]) == (2 * 3 * 3, 8)
    else:  # a SIMD group per vector, 4 per thread group
        assert grid[0] // group[0] == -(-2 * 3 * 77 // 4)


def test_vecinfer_fused_encoder_launches_one_kernel_with_the_pure_mlx_codes_field(tmp_path, monkeypatch,
                                                                                  cuda_launches):
    """vecinfer's fused encoder (the transform in MLX, then one kernel) returns the pure-MLX encoder's field, shape
    and dtype; without a calibration it leaves quantize to pure MLX, whose error names the command to run."""
    from kvq_backends_vecinfer import kernels as vk, storage

    from test_vecinfer import _calibrated

    monkeypatch.setenv("KVQ_DATA_DIR", str(tmp_path))
    storage.forget()
    try:
        _, kp, _ = _calibrated(sub_dim=4, code_bits=6)
        launches = cuda_launches
        impl = kvq.registry().implementations[("vecinfer", "cuda")]
        pure = kvq.registry().implementations[("vecinfer", "mlx")]
        params = kp.for_layer(1)
        x = mx.random.normal((1, 2, 50, 64)).astype(mx.float16)
        got, want = impl.kvq_quantize(x, params), pure.kvq_quantize(x, params)
        assert [k["name"] for k in launches] == [launches[0]["name"]] and "vq_encode" in launches[0]["name"]
        assert (got.data["codes"].shape, got.data["codes"].dtype) == (want.data["codes"].shape, mx.uint32)
        assert launches[0]["grid"][0] // launches[0]["threadgroup"][0] == 2 * -(-50 // vk.ENCODER_WARPS)
        missing = kvq.make_params("vecinfer", model_id="not-calibrated", layer=0)
        assert not vk.encoder_supports(params.__class__(sub_dim=4, code_bits=12), 64, mx.float16)
        with pytest.raises(storage.CalibrationError, match="kvq calibrate"):
            impl.kvq_quantize(x, missing)
    finally:
        storage.forget()


def test_launch_bounds_name_the_kernel_mlx_writes():
    """``MINB`` > 0 puts ``__launch_bounds__(THREADS, MINB)`` before the name MLX gives the CUDA kernel
    (``custom_kernel_NAME``) and undefines the macro again; none asked for (0 or absent), no lines."""
    from kvq_metal.dialect import launch_bounds

    assert launch_bounds("kvq_x_b1", {"THREADS": 128, "MINB": 0}) == ("", "")
    assert launch_bounds("kvq_x_b1", {"THREADS": 128}) == ("", "")
    define, undefine = launch_bounds("kvq_x_b1", {"THREADS": 128, "MINB": 3})
    assert define.strip() == "#define custom_kernel_kvq_x_b1 __launch_bounds__(128, 3) custom_kernel_kvq_x_b1"
    assert undefine == "#undef custom_kernel_kvq_x_b1\n"


def test_bound_launch_bounds_end_where_the_body_starts(monkeypatch):
    """A bound CUDA launch with ``MINB`` hands MLX a header that defines the macro and a body that starts by undefining
    it (MLX's name lookup after the body must see the plain name); without ``MINB``, neither."""
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: kw)  # the build arguments, as MLX would get them
    kernel = dialect.Kernel("probe", "cuda", ["a"], ["out"], "out[0] = a[0];", "", True)
    call, _, _ = kernel.bound([("THREADS", 128), ("MINB", 3)], [mx.zeros((1,))])
    name = f"custom_kernel_{call['name']}"
    assert call["header"].endswith(f"#define {name} __launch_bounds__(128, 3) {name}\n")
    assert call["source"].startswith(f"#undef {name}\n")
    plain, _, _ = kernel.bound([("THREADS", 128), ("MINB", 0)], [mx.zeros((1,))])
    assert "__launch_bounds__" not in plain["header"] and "#undef" not in plain["source"]


def test_ragged_decode_step_passes_each_rows_counts(cuda_launches):
    """A ragged decode step (a packed batch of sequences of different lengths, kvq.cache.packed) is the tensor-core
    kernel built with ``RAGGED`` that takes the per-row counts as its last input, passed per call; an ordinary
    bound step leaves that input out of its signature (read through the counters' alias), so its launch is as
    before."""
    from kvq_metal.step import DecodeStep

    impl = kvq.registry().implementations[("turboquant", "cuda")]
    pure = kvq.registry().implementations[("turboquant", "mlx")]
    params = kvq.make_params("turboquant", bits=3)
    keys = pure.kvq_quantize(mx.random.normal((2, 2, 300, 128)).astype(mx.bfloat16), params)
    values = pure.kvq_quantize(mx.random.normal((2, 2, 300, 128)).astype(mx.bfloat16), params)
    sk, wk = mx.zeros((2, 2, 4, 128), mx.bfloat16), mx.zeros((2, 2, 40, 128), mx.bfloat16)
    q = mx.zeros((2, 8, 1, 128), mx.bfloat16)
    lengths = mx.array([[300, 40], [120, 7]], dtype=mx.int32)
    ragged = impl._bind_unchecked(q, keys, values, 0.1, sk, sk, wk, wk, ragged=True)
    plain = impl._bind_unchecked(q, keys, values, 0.1, sk, sk, wk, wk)
    assert type(ragged) is DecodeStep and type(plain) is DecodeStep and ragged.ragged and not plain.ragged
    assert dict(ragged.template_args)["RAGGED"] is True and dict(plain.template_args)["RAGGED"] is False
    ragged(q, wk, wk, lengths)
    plain(q, wk, wk)
    ours, theirs = cuda_launches[-2:]
    assert ours["input_names"][-1] == "lens" and ours["inputs"][-1] is lengths
    assert "lens" not in theirs["input_names"] and len(theirs["inputs"]) == len(ours["inputs"]) - 1
    assert "RAGGED = true" in ours["source"] and "RAGGED = false" in theirs["source"]


@pytest.mark.parametrize("B,T,splits", [(1, 131072, 31), (1, 4096, 16), (16, 32768, 1), (33, 32768, 2),
                                        (122, 32768, 2), (122, 100, 1)])
def test_tensor_core_splits_per_row(B, T, splits):
    """The tensor-core launch's grid (``kvq_metal.attend._tc_geometry``, pure Python): ``B * 8`` (batch, KV head) rows
    of 2 uncompressed blocks plus the compressed tokens' splits, aiming at ``TUNING.tc_groups`` (264) blocks in
    all; once the rows alone reach that target (a batch of 33 sequences or more here), two splits per row (measured
    on the H200 at 122 sequences of 32K: 0.93-0.94x the time of one), unless the row has a single 128-token tile."""
    from kvq_metal import attend

    plan = attend.LaunchPlan(True, [], 128, 32 * 128 // 4 - 2, 2)
    grid, shapes, _ = attend._tc_geometry(plan, (B, 32, 1, 128), 8, T, 128, 4, 128, "cuda", mx.float16)
    assert grid == (attend.THREADS * B * 8, splits + 2, 1)
    assert shapes[0] == (B, 8, splits + 2, 4, 128)
    chunk = attend.split_chunk(T, splits, 128)
    assert (splits - 1) * chunk < T <= splits * chunk  # every token in one split, none empty


def test_a_size_input_carries_its_size_in_its_shape():
    """:func:`kvq_metal.dialect.size_input`: uint8 ``[n + 1]`` (a kernel reads ``n`` as its shape less one), a
    prefix of one zero buffer grown to the largest size asked; a negative size is refused."""
    from kvq_metal.dialect import size_input

    for n in (0, 5, 70_000, 3):
        carrier = size_input(n)
        assert carrier.shape == (n + 1,) and carrier.dtype == mx.uint8 and not mx.any(carrier).item()
    with pytest.raises(ValueError, match="n must be >= 0"):
        size_input(-1)
    with pytest.raises(ValueError, match="after must be >= 0; got -2"):  # the launchers name their argument
        size_input(-2, "after")
