"""kvq_metal.prefill without a GPU: argument checks (each bad input names its argument), :func:`supported`, the
launch plan (template, grid, shared memory), and the float32 reference the GPU parity tests
(``tests/test_prefill_kernel_gpu.py``) compare the kernel with, against MLX's attention with kvq's own mask."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvq.cache.parts import Part
from kvq.cache.prefill import interval_mask
from kvq_metal import dialect, kernel_files, prefill

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="CPU-only behaviour")


def _inputs(B=1, Hq=4, Hkv=2, Tq=8, N=40, D=64, Dv=None, dtype=mx.float16, P=2):
    q = mx.zeros((B, Hq, Tq, D), dtype)
    k = mx.zeros((B, Hkv, N, D), dtype)
    v = mx.zeros((B, Hkv, N, Dv or D), dtype)
    iv = mx.zeros((Tq, P, 2), mx.int32)
    return q, k, v, iv


BAD = [
    # (the argument changed, its new value from the good arguments, the error, words its message must hold)
    ("queries", lambda a: a["queries"].astype(mx.float32), TypeError, "queries must be float16 or bfloat16"),
    ("keys", lambda a: a["keys"].astype(mx.bfloat16), TypeError, "keys must have the queries' dtype"),
    ("values", lambda a: a["values"].astype(mx.float32), TypeError, "values must have the queries' dtype"),
    ("queries", lambda a: np.zeros((1, 4, 8, 64), np.float16), TypeError, "queries must be an mlx array"),
    ("queries", lambda a: a["queries"][0], ValueError, "queries must be [B, heads, tokens, dim]"),
    ("keys", lambda a: a["keys"][..., :32], ValueError, "keys must be [1, H_kv, N, 64]"),
    ("keys", lambda a: mx.concatenate([a["keys"]] * 2), ValueError, "keys must be [1, H_kv, N, 64]"),
    ("values", lambda a: a["values"][:, :, :30], ValueError, "values must be [1, 2, 40, D_v]"),
    ("queries", lambda a: a["queries"][:, :3], ValueError, "query heads (3) must be a multiple of the key heads (2)"),
    ("values", lambda a: a["values"][..., :32], ValueError, "value_dim 32"),
    ("intervals", lambda a: a["intervals"].astype(mx.float32), TypeError,
     "intervals must be int32; got mlx.core.float32"),
    ("intervals", lambda a: a["intervals"].astype(mx.int64), TypeError, "intervals must be int32"),
    ("intervals", lambda a: np.zeros((8, 2, 2), np.float32), TypeError, "intervals must be int32; got numpy"),
    ("intervals", lambda a: [[0, 1]] * 8, TypeError, "intervals must be an int32 mlx array"),
    ("intervals", lambda a: a["intervals"][:7], ValueError, "intervals must be [T_q=8, P, 2]"),
    ("intervals", lambda a: a["intervals"][..., :1], ValueError, "intervals must be [T_q=8, P, 2]"),
    ("intervals", lambda a: a["intervals"][:, 0], ValueError, "intervals must be [T_q=8, P, 2]"),
    ("intervals", lambda a: mx.zeros((8, 5, 2), mx.int32), ValueError, "1 to 4 intervals per row (P); got 5"),
    ("intervals", lambda a: mx.zeros((8, 0, 2), mx.int32), ValueError, "1 to 4 intervals per row (P); got 0"),
    ("sink_logits", lambda a: mx.zeros((3,)), ValueError, "sink_logits must be [H_q=4]"),
    ("sink_logits", lambda a: mx.zeros((4,), mx.int32), TypeError, "sink_logits must be a floating-point mlx array"),
    ("scale", lambda a: float("nan"), ValueError, "scale must be a positive finite float"),
    ("scale", lambda a: -0.1, ValueError, "as the kernel reads it); got -0.1"),
    ("scale", lambda a: 1e-50, ValueError, "as the kernel reads it); got 1e-50"),  # 0 in float32: NaN scores
    ("scale", lambda a: 1e50, ValueError, "as the kernel reads it); got 1e+50"),  # inf in float32
    ("scale", lambda a: "0.1", TypeError, "scale must be a positive finite float; got str"),
    ("queries", lambda a: a["queries"][:, :, :0], ValueError, "at least one token; got T_q 0"),
]


@pytest.mark.parametrize("case", range(len(BAD)), ids=lambda i: f"{BAD[i][0]}-{i}")
def test_bad_input_raises_naming_the_argument(case):
    name, change, error, words = BAD[case]
    args = dict(zip(("queries", "keys", "values", "intervals"), _inputs()), scale=0.125)
    args[name] = change(args)
    with pytest.raises(error) as info:
        prefill.prefill_attend(**args)
    assert words in str(info.value)


def test_unsupported_head_dim_names_the_served_ones():
    q, k, v, iv = _inputs(D=96)
    with pytest.raises(ValueError, match=r"head_dim must be one of \[64, 128, 256\].*got head_dim 96"):
        prefill.prefill_attend(q, k, v, iv, 0.1)


def test_good_input_passes_the_checks_and_needs_cuda():
    """Valid arguments (numpy int64 intervals, float16 sink logits) get past every check to the device test: on a
    CPU the call says that the kernel runs on MLX's CUDA back end only."""
    q, k, v, _ = _inputs(dtype=mx.bfloat16)
    iv = np.tile(np.array([[0, 5], [10, 2**40]], np.int64), (8, 1, 1))
    checked, sinks = prefill.check_inputs(q, k, v, iv, 0.1, mx.ones((4,), mx.float16))
    assert checked.dtype == mx.int32 and checked.shape == (8, 2, 2)
    assert checked[0].tolist() == [[0, 5], [10, 2**31 - 1]]  # past int32: clipped (columns past N are ignored)
    assert sinks.dtype == mx.float32 and sinks.tolist() == [1.0] * 4
    with pytest.raises(RuntimeError, match="CUDA back end only"):
        prefill.prefill_attend(q, k, v, iv, 0.1, mx.ones((4,), mx.float16))


def test_supported_shapes():
    for D in (64, 128, 256):
        for dtype in (mx.float16, mx.bfloat16):
            assert prefill.supported(D, D, dtype, 1) and prefill.supported(D, D, dtype, 4)
            assert not prefill.supported(D, D, dtype, 0) and not prefill.supported(D, D, dtype, 5)
        assert not prefill.supported(D, D, mx.float32) and not prefill.supported(D, D // 2, mx.float16)
    for D in (32, 80, 96, 112, 192, 512):
        assert not prefill.supported(D, D, mx.float16)


def test_launch_plan_for_a_gqa_chunk():
    """Llama-3-8B's shape: 32 query heads on 8 KV heads, a chunk of 2048 rows, bfloat16, kvq's 3 intervals."""
    plan = prefill.launch_plan((2, 32, 2048, 128), (2, 8, 9000, 128), mx.bfloat16, 3, 128 ** -0.5, True)
    t = dict(plan.template)
    assert [name for name, _ in plan.template] == ["D", "DV", "BC", "BR", "P", "SINK", "BF16", "SCALE", "THREADS",
                                                   "MINB", "WG", "PIPE"]
    assert (t["THREADS"], t["MINB"], t["WG"], t["PIPE"]) == (128, 0, False, False) and plan.dynamic_bytes == 0
    assert (t["D"], t["DV"], t["BC"], t["BR"], t["P"], t["SINK"], t["BF16"]) == (128, 128, 64, 64, 3, True, True)
    assert dialect.float_bits(128 ** -0.5) == t["SCALE"] == 0x3DB504F3
    # 4 heads x 2048 rows per (batch, KV head) group, 64 rows per block of 128 threads
    assert plan.grid == (128 * 128, 16, 1) and plan.threadgroup == (128, 1, 1)
    assert plan.output_shapes == ((2, 32, 2048, 128), (2, 32, 2048))
    assert plan.output_dtypes == (mx.bfloat16, mx.float32)
    assert plan.shared_bytes == 64 * 256 * 2 + 8 * 3 * 65  # K and V tiles, 64 rows' intervals and their union
    # the wgmma form: 2 warpgroups of 64 rows a block (256 threads, half the blocks); at head_dim 256 none
    wg = prefill.launch_plan((2, 32, 2048, 128), (2, 8, 9000, 128), mx.bfloat16, 3, 128 ** -0.5, True, 0, 2)
    assert (dict(wg.template)["WG"], dict(wg.template)["BR"], wg.threadgroup) == (True, 128, (256, 1, 1))
    assert wg.grid == (64 * 256, 16, 1) and wg.shared_bytes == 64 * 256 * 2 + 8 * 3 * 129
    assert [prefill.wgmma_serves(D) for D in (64, 128, 256, 96)] == [True, True, False, False]
    assert dict(prefill.launch_plan((1, 8, 9, 256), (1, 2, 9, 256), mx.float16, 1, 0.1, False, 0, 1).template)[
        "WG"] is False
    # the pipelined wgmma form: two stages of the K and V tiles in dynamic shared memory (+1024 to align them), the
    # intervals alone static (rounded to 16 bytes); without wgmma (mma.sync, head_dim 256) no pipeline
    pipe = prefill.launch_plan((2, 32, 2048, 128), (2, 8, 9000, 128), mx.bfloat16, 1, 128 ** -0.5, True, 0, 1, True)
    assert (dict(pipe.template)["WG"], dict(pipe.template)["PIPE"]) == (True, True)
    assert pipe.dynamic_bytes == 2 * 64 * 256 * 2 + 1024 and pipe.shared_bytes == 528  # 8 * 65 = 520, to 16
    for warpgroups, D in ((0, 128), (1, 256)):
        plain = prefill.launch_plan((1, 8, 9, D), (1, 2, 9, D), mx.float16, 1, 0.1, False, 0, warpgroups, True)
        assert dict(plain.template)["PIPE"] is False and plain.dynamic_bytes == 0


@pytest.mark.parametrize(("shape", "keys", "blocks", "slices", "columns"), [
    ((1, 8, 1, 64), (1, 1, 100, 64), 1, 1, 64),        # one row of 8 heads: one block
    ((1, 4, 100, 64), (1, 4, 100, 64), 2, 1, 64),      # no GQA: 100 rows, a partial second block
    ((3, 28, 17, 128), (3, 4, 50, 128), 2, 1, 64),     # 7 heads per KV head: 119 rows
    ((1, 16, 512, 256), (1, 8, 600, 256), 16, 2, 32),  # head_dim 256: two blocks per rows, half the values each
])
def test_launch_plan_grid(shape, keys, blocks, slices, columns):
    plan = prefill.launch_plan(shape, keys, mx.float16, 1, 0.1, False)
    assert plan.grid == (blocks * 128, shape[0] * keys[1], slices)
    assert dict(plan.template)["BC"] == columns and dict(plan.template)["DV"] == shape[3] // slices
    assert not dict(plan.template)["SINK"] and not dict(plan.template)["BF16"]


def test_every_served_launch_fits_static_shared_memory():
    for D in prefill.TILE_COLUMNS:
        for P in range(1, prefill.MAX_INTERVALS + 1):
            plan = prefill.launch_plan((1, 8, 64, D), (1, 2, 64, D), mx.float16, P, 0.1, True)
            assert plan.shared_bytes <= prefill.STATIC_SHARED_BYTES, (D, P)
            assert plan.shared_bytes >= 2 * 16 * D  # at least two 16-column tiles of K and V


def test_kernel_file_is_registered_for_cuda_only():
    source = kernel_files.LOADED["prefill_attend_tc"]
    assert source.backends == ("cuda",)
    assert (source.reference, source.launcher) == ("kvq_metal.prefill.reference_attend",
                                                   "kvq_metal.prefill.prefill_attend")
    assert "kvq_pf_mma" in source.header and "kvq_pf_mma" in source.source


def test_visibility_is_the_union_of_a_rows_intervals():
    iv = mx.array([[[0, 2], [4, 6]], [[1, 1], [5, 3]], [[-3, 1], [2, 99]], [[0, 3], [1, 4]]], mx.int32)
    got = np.array(prefill.visibility(iv, 7)).astype(int).tolist()
    assert got == [[1, 1, 0, 0, 1, 1, 0], [0] * 7, [1, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]]


def _kvq_parts(Tq: int, sinks: int, compressed: int, window: int, rng) -> tuple[list, np.ndarray]:
    """kvq-like parts of a chunk of ``Tq`` rows (:class:`kvq.cache.parts.Part`): sinks every row sees, a compressed
    prefix whose bound steps every 16 rows, and a dense band (``window`` tokens before the chunk, then the chunk:
    causal, from the row's first uncompressed token); and the same visibility as ``[Tq, 3, 2]`` intervals over the
    parts side by side."""
    r = np.arange(Tq)
    bound = np.minimum(compressed, compressed - 16 * ((Tq - 1) // 16) + 16 * (r // 16))
    start = bound - bound[0]  # dense tokens that later rows see compressed
    parts = []
    for n, index, lo, hi in ((sinks, 0, None, None), (compressed, 0, np.zeros(Tq, np.int64), bound),
                             (window + Tq, 7, start + 7, window + r + 1 + 7)):  # a dense part indexed from 7
        x = mx.array(rng.standard_normal((1, 2, n, 16)).astype(np.float32))
        parts.append(Part(x, x * 0.5, False, index, lo, hi))
    iv = np.zeros((Tq, 3, 2), np.int64)
    first = 0
    for p, part in enumerate(parts):
        lo = 0 if part.lo is None else part.lo - part.index
        hi = part.size if part.hi is None else part.hi - part.index
        iv[:, p, 0], iv[:, p, 1] = first + lo, first + hi
        first += part.size
    return parts, iv


@pytest.mark.parametrize("sinks", [False, True])
def test_reference_matches_mlx_attention_with_kvqs_mask(sinks):
    """:func:`reference_attend` over intervals equals ``mx.fast.scaled_dot_product_attention`` with the additive mask
    kvq's chunk path builds from the same parts (:func:`kvq.cache.prefill.interval_mask`), with learned sink logits
    passed as MLX's ``sinks=``: the reference the GPU tests hold the kernel to is kvq's visibility rule."""
    rng = np.random.default_rng(1)
    Tq = 40
    parts, iv = _kvq_parts(Tq, 4, 50, 6, rng)
    keys = mx.concatenate([p.keys for p in parts], axis=2)
    values = mx.concatenate([p.values for p in parts], axis=2)
    N = keys.shape[2]
    q = mx.array(rng.standard_normal((1, 4, Tq, 16)).astype(np.float32))
    sink = mx.array(rng.standard_normal(4).astype(np.float32)) if sinks else None
    mask = interval_mask(parts, 0, Tq, N, mx.float32)
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.25, mask=mask, sinks=sink)
    got, lse = prefill.reference_attend(q, keys, values, iv.astype(np.int32), 0.25, sink)
    assert float(mx.abs(got - want).max()) < 1e-5
    # the log-sum-exp of the visible scaled scores (and the sink logit)
    s = np.einsum("hqd,hkd->hqk", np.array(q[0]) * 0.25, np.repeat(np.array(keys[0]), 2, axis=0))
    s = np.where(np.array(mask) == 0, s, -np.inf)
    if sinks:
        s = np.concatenate([np.broadcast_to(np.array(sink)[:, None, None], (4, Tq, 1)), s], axis=-1)
    assert np.allclose(np.array(lse[0]), np.logaddexp.reduce(s, axis=-1), atol=1e-5)


def test_reference_rows_that_see_nothing():
    """A row with only empty intervals gets out 0 and lse -inf, or the sink logit with sink logits."""
    q, k, v = (mx.ones((1, 2, 3, 8)),) * 3
    iv = mx.array([[[0, 2]], [[5, 5]], [[1, 3]]], mx.int32)
    out, lse = prefill.reference_attend(q, k, v, iv, 1.0)
    assert float(mx.abs(out[:, :, 1]).max()) == 0.0 and float(mx.abs(out[:, :, 0] - 1).max()) < 1e-6
    assert lse[0, :, 1].tolist() == [-np.inf] * 2
    out, lse = prefill.reference_attend(q, k, v, iv, 1.0, mx.array([0.5, -2.0]))
    assert float(mx.abs(out[:, :, 1]).max()) == 0.0 and lse[0, :, 1].tolist() == [0.5, -2.0]


def test_the_first_use_checks_intervals_are_disjoint_parts_of_a_chunk():
    """:func:`kvq_metal.prefill.check_intervals`: per row, up to four disjoint intervals inside the 260 columns (a
    causal band that grows by one column a row, compressed columns, sinks, a second window piece), one row (row 0)
    whose fourth interval is not empty."""
    iv = prefill.check_intervals(4, 83)
    assert iv.shape == (83, 4, 2) and iv.dtype == np.int32
    assert (iv[..., 0] >= 0).all() and (iv[..., 1] <= 260).all() and (iv[..., 0] <= iv[..., 1]).all()
    assert (np.diff(iv[:, 0, 1]) == 1).all()  # the causal band
    for row in iv:
        spans = sorted(map(tuple, row))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint
    assert [prefill.check_intervals(p, 83).shape[1] for p in (1, 2, 3)] == [1, 2, 3]


@pytest.mark.parametrize("sinks", [False, True])
def test_the_first_use_check_passes_the_reference_and_fails_a_kernel_that_drops_an_interval(sinks, monkeypatch):
    """:func:`kvq_metal.prefill.check_parity` with the kernel replaced by its float32 reference rounded to the
    queries' dtype passes at every head_dim, with 1 to 4 intervals and GQA 1 and 4; a kernel that ignores the
    fourth interval, or one that ignores the sink logits, fails (the check can fail where the kernel would be
    wrong)."""
    def reference(q, k, v, intervals, scale, sink_logits=None, return_lse=False):
        out, lse = prefill.reference_attend(q, k, v, intervals, scale, sink_logits)
        return (out.astype(q.dtype), lse) if return_lse else out.astype(q.dtype)

    monkeypatch.setattr(prefill, "prefill_attend", reference)
    for D, P, n_rep in ((64, 4, 1), (128, 3, 4), (256, 1, 4)):
        ok, detail = prefill.check_parity(D, mx.bfloat16, P, sinks, n_rep)
        assert ok, detail

    def drops_the_fourth(q, k, v, intervals, scale, sink_logits=None, return_lse=False):
        return reference(q, k, v, mx.array(np.asarray(intervals)[:, :3]), scale, sink_logits, return_lse)

    monkeypatch.setattr(prefill, "prefill_attend", drops_the_fourth)
    assert not prefill.check_parity(64, mx.float16, 4, sinks, 2)[0]
    if sinks:
        monkeypatch.setattr(prefill, "prefill_attend", lambda q, k, v, iv, scale, s=None, return_lse=False:
                            reference(q, k, v, iv, scale, None, return_lse))
        assert not prefill.check_parity(64, mx.float16, 3, sinks, 2)[0]
