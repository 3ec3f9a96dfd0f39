"""kvq_metal kernels against their pure-MLX implementations, on a GPU (``pytest -m gpu``; skipped elsewhere).

Tolerances (issue #8): attention within 1e-3 relative (float32 sums in another order); codes exact except
where a rotated coordinate lies within float rounding of a cell boundary (the Hadamard transform sums in another
order than ``mx.hadamard_transform``), so at most 0.1% of codes may differ and the reconstruction MSE is within
1% of pure MLX's.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest

import kvq
from kvq.plugins import registry

pytestmark = pytest.mark.gpu

kvq_metal = pytest.importorskip("kvq_metal")
from kvq_metal.baselines import affine as affine_kernels  # noqa: E402
from kvq_metal.common import code_mismatch  # noqa: E402


def _impl(method):
    backend = kvq_metal.gpu_backend()
    if backend is None:
        pytest.skip("no Metal or CUDA device")
    return registry().implementations[(method, backend)], registry().implementations[(method, "mlx")]


def _rel(a, b):
    a, b = np.asarray(a.astype(mx.float32)), np.asarray(b.astype(mx.float32))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _normal(shape, dtype=mx.float16, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


# -- decode attention -------------------------------------------------------------------------------------
ATTEND_CASES = [
    # method, params, head_dim, n_rep, T_q, T
    ("turboquant", {"bits": 4}, 128, 4, 1, 5000),
    ("turboquant", {"bits": 3}, 128, 4, 1, 300),
    ("turboquant", {"bits": 2}, 128, 1, 1, 1),
    ("turboquant", {"bits": 1}, 64, 8, 1, 129),
    ("turboquant", {"bits": 4, "norm_dtype": "float32"}, 256, 2, 2, 1000),
    ("turboquant", {"bits": 3}, 120, 4, 2, 777),  # head_dim 120 rotates zero-padded to 128
    ("turboquant", {"bits": 4, "rotation": "qr"}, 128, 4, 1, 600),
    ("affine", {"bits": 4, "group_size": 64}, 128, 4, 1, 5000),
    ("affine", {"bits": 8, "group_size": 32}, 128, 4, 1, 300),
    ("affine", {"bits": 2, "group_size": 64}, 64, 8, 1, 257),
    ("affine", {"bits": 3, "group_size": 128}, 256, 2, 1, 1000),
    ("affine", {"bits": 6, "group_size": 64}, 128, 1, 1, 64),
    # 4-bit levels decoded without a table (kvq_metal.attend_tc.linear): keys and values, keys only at head_dim 32
    ("affine", {"bits": 4, "group_size": 32}, 64, 4, 1, 700),
    ("affine", {"bits": 4, "group_size": 128}, 256, 8, 1, 300),
    ("affine", {"bits": 4, "group_size": 32}, 32, 4, 2, 200),
    ("turboquant_rvq", {"bits": 2, "residual_bits": 1}, 128, 4, 1, 3000),
    ("turboquant_rvq", {"bits": 2, "residual_bits": 2}, 128, 4, 1, 300),
    ("turboquant_rvq", {"bits": 3, "residual_bits": 3}, 64, 8, 1, 500),
    ("turboquant_rvq", {"bits": 4, "residual_bits": 4, "rotation": "qr"}, 128, 2, 2, 257),
]


def _tensor_cores(tc: bool, module):
    """Set ``module.TUNING.tc`` (a family's frozen launch knobs, :mod:`kvq_metal.knobs`) to ``tc`` (a fixture's
    parameter) for one test (``simt`` on CUDA only), and back after it."""
    if not tc and kvq_metal.gpu_backend() != "cuda":
        pytest.skip("the tensor-core kernel exists on CUDA only")
    for _ in _knobs(module, {"tc": bool(tc)}, cuda_only=False):
        yield tc


def _knobs(module, knobs: dict, cuda_only: bool = True):
    """Swap ``module.TUNING`` for a copy with ``knobs`` for one test, and back after it (CUDA only)."""
    if knobs and cuda_only and kvq_metal.gpu_backend() != "cuda":
        pytest.skip("the tensor-core kernel exists on CUDA only")
    saved = module.TUNING
    module.TUNING = attrs.evolve(saved, **knobs)
    try:
        yield knobs
    finally:
        module.TUNING = saved


#: The tensor-core decode kernel with the knobs the default does not take: query fragments held in registers
#: (the default reads them from shared memory), one tile of 16 tokens per warp step (``kvq_metal.attend.TUNING``).
ATTEND_TC_VARIANT = {"qsh": False, "nt": 1}


@pytest.fixture(params=[True, False, "tc_regs"], ids=["tensor_cores", "simt", "tc_regs"])
def attend_kernel_kind(request):
    """Both decode-attention kernels: on CUDA the tensor-core kernel serves the shapes it supports by default and
    the SIMT kernel (the Metal design) the rest; ``simt`` forces the SIMT kernel everywhere; ``tc_regs`` is the
    tensor-core kernel with :data:`ATTEND_TC_VARIANT`."""
    from kvq_metal import attend

    for _ in _knobs(attend, ATTEND_TC_VARIANT if request.param == "tc_regs" else {}):
        yield from _tensor_cores(request.param is not False, attend)


@pytest.fixture(params=[False, True], ids=["default", "tc_regs"])
def attend_tc_knobs(request):
    """The tensor-core decode kernel as it is by default, and with :data:`ATTEND_TC_VARIANT`."""
    from kvq_metal import attend

    yield from _knobs(attend, ATTEND_TC_VARIANT if request.param else {})


@pytest.mark.parametrize("case", range(len(ATTEND_CASES)))
def test_decode_attend_matches_pure_mlx(case, attend_kernel_kind):
    method, params, D, n_rep, Tq, T = ATTEND_CASES[case]
    dtype = (mx.float16, mx.bfloat16, mx.float32)[case % 3]
    kernel, pure = _impl(method)
    p = kvq.make_params(method, **params)
    Hkv = 2
    k, v = _normal((1, Hkv, T, D), dtype, 1), _normal((1, Hkv, T, D), dtype, 2)
    q = _normal((1, Hkv * n_rep, Tq, D), dtype, 3)
    ke, ve = pure.kvq_quantize(k, p), pure.kvq_quantize(v, p)
    out, lse = kernel.kvq_attend(q, ke, ve, D ** -0.5, None)
    ref, ref_lse = pure.kvq_attend(q, ke, ve, D ** -0.5, None)
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    assert _rel(out, ref) < 1e-3
    assert float(mx.max(mx.abs(lse - ref_lse))) < 1e-3


@pytest.mark.parametrize("bits", [3, 4])
def test_decode_attend_rising_scores_with_large_value_norms(bits):
    """The online softmax's kept max (``AttendKnobs.slack``: between moves, probabilities up to 2^slack) over scores
    that rise through the tokens, with value norms near 3,340 folded into the float16 probabilities (16 times that
    is 53,440: inside float16 at a slack of 4; the default is 0). One split per row (``tc_groups`` 2), so each warp
    takes about 10 steps of 128 tokens: its running max rises about 0.3 nats a step, moves every few steps and holds
    (the no-move branch) in between. The kernel at slack 4 equals the kernel at 0 (the textbook online softmax)
    within the float16 rounding of the probabilities: the two take them against maxima that differ by a factor that
    is not a power of two, so each rounds differently, by up to 2^-11 of itself (3.4e-4 and 2.9e-4 of the output
    at 3 and 4 bits, measured on an H100); their normalisers are float32 sums and agree to 1e-4. Both equal pure
    MLX."""
    from kvq_metal import attend

    kernel, pure = _impl("turboquant")
    p = kvq.make_params("turboquant", bits=bits)
    D, Hkv, n_rep, T = 128, 2, 4, 5000
    rng = np.random.default_rng(11)
    u = rng.standard_normal(D).astype(np.float32)
    u /= np.linalg.norm(u)
    rise = (np.arange(T, dtype=np.float32) / T * 12.0)[:, None] * u  # q = u, scale 1: scores rise by 12 nats
    k = mx.array(rng.standard_normal((1, Hkv, T, D)).astype(np.float32) * 0.1 + rise).astype(mx.float16)
    v = _normal((1, Hkv, T, D), mx.float16, 12, scale=240.0)
    q = mx.array(np.broadcast_to(u, (1, Hkv * n_rep, 1, D)).copy()).astype(mx.float16)
    ke, ve = pure.kvq_quantize(k, p), pure.kvq_quantize(v, p)
    assert 3000 < float(mx.max(ve.data["norms"].astype(mx.float32))) < 65504 / 2 ** 4
    outs = {}
    for slack in (4, 0):
        for _ in _knobs(attend, {"slack": slack, "tc_groups": 2}):
            outs[slack] = kernel.kvq_attend(q, ke, ve, 1.0, None)
    ref, ref_lse = pure.kvq_attend(q, ke, ve, 1.0, None)
    (out, lse), (out0, lse0) = outs[4], outs[0]
    assert bool(mx.all(mx.isfinite(out)))
    assert _rel(out, out0) < 2 ** -10 and float(mx.max(mx.abs(lse - lse0))) < 1e-4 * float(mx.max(mx.abs(lse0)))
    for o, l in ((out, lse), (out0, lse0)):
        assert _rel(o, ref) < 1e-3
        # scores reach 12 (the decoded keys' float16 rounding moves them by about 1e-3 each): lse to 1e-3 of itself
        assert float(mx.max(mx.abs(l - ref_lse))) < 1e-3 * float(mx.max(mx.abs(ref_lse)))


@pytest.mark.parametrize("bits", [3, 4])
def test_decode_attend_value_norms_beyond_a_slack_of_4_at_the_defaults(bits):
    """Value norms near 20,000, above the 4,094 that a softmax slack of 4 allows (``AttendKnobs.slack``: norms are
    folded into float16 probabilities of up to 2^slack), attended at the default knobs (slack 0, probabilities at
    most 1): finite, and pure MLX's output and log-sum-exp within the tolerances of the parity tests. The reason
    the default is 0."""
    from kvq_metal import attend

    assert attend.TUNING.slack == 0
    kernel, pure = _impl("turboquant")
    p = kvq.make_params("turboquant", bits=bits)
    D, Hkv, n_rep, T = 128, 2, 4, 3000
    k = _normal((1, Hkv, T, D), mx.float16, 21)
    v = _normal((1, Hkv, T, D), mx.float16, 22, scale=1440.0)
    q = _normal((1, Hkv * n_rep, 1, D), mx.float16, 23)
    ke, ve = pure.kvq_quantize(k, p), pure.kvq_quantize(v, p)
    assert 4094 * 3 < float(mx.max(ve.data["norms"].astype(mx.float32))) < 65504 / 2
    out, lse = kernel.kvq_attend(q, ke, ve, D ** -0.5, None)
    ref, ref_lse = pure.kvq_attend(q, ke, ve, D ** -0.5, None)
    assert bool(mx.all(mx.isfinite(out)))
    assert _rel(out, ref) < 1e-3 and float(mx.max(mx.abs(lse - ref_lse))) < 1e-3


@pytest.mark.parametrize("D,group", [(32, 32), (64, 32), (128, 64), (256, 128), (256, 32)])
def test_affine_4_bit_decode_without_tables_equals_the_table_path(D, group, attend_tc_knobs):
    """The tensor-core kernel's arithmetic decode of 4-bit affine codes (knob ``lin``, kvq_metal.attend_tc.linear)
    gives the table's values exactly, so its output equals the table path's up to the order of float32 additions
    (the coordinates pair differently inside the tensor-core products); with the default knobs and with query
    fragments in registers and one tile per step. The plan is checked to decode without tables where lin is on."""
    from kvq_metal import attend

    kernel, pure = _impl("affine")
    if kvq_metal.gpu_backend() != "cuda":
        pytest.skip("the tensor-core kernel exists on CUDA only")
    p = kvq.make_params("affine", bits=4, group_size=group)
    k, v = _normal((1, 2, 600, D), mx.float16, 1), _normal((1, 2, 600, D), mx.float16, 2)
    q = _normal((1, 8, 1, D), mx.float16, 3)
    ke, ve = pure.kvq_quantize(k, p), pure.kvq_quantize(v, p)
    outs = []
    for lin in (True, False):
        for _ in _knobs(attend, {"lin": lin}):
            plan, *_ = attend._plan_for(q.shape, D ** -0.5, affine_kernels._side(ke), affine_kernels._side(ve),
                                        "cuda", False, None, None)
            assert plan.tc and (dict(plan.template)["KLIN"], dict(plan.template)["VLIN"]) == (lin, lin and D >= 64)
            out, lse = kernel.kvq_attend(q, ke, ve, D ** -0.5, None)
            mx.eval(out, lse)
            outs.append((out, lse))
    assert _rel(outs[0][0], outs[1][0]) < 1e-5
    assert float(mx.max(mx.abs(outs[0][1] - outs[1][1]))) < 1e-5


def test_decode_attend_reads_strided_store_in_place(attend_kernel_kind):
    """The cache's compressed store is a prefix view of a larger buffer: the kernel must read the view."""
    kernel, pure = _impl("turboquant")
    p = kvq.make_params("turboquant", bits=4)
    k, v = _normal((1, 2, 1024, 128), seed=4), _normal((1, 2, 1024, 128), seed=5)
    ke, ve = pure.kvq_quantize(k, p), pure.kvq_quantize(v, p)
    kv, vv = ke.tokens(0, 700), ve.tokens(0, 700)
    q = _normal((1, 8, 1, 128), seed=6)
    out, _ = kernel.kvq_attend(q, kv, vv, 0.1, None)
    ref, _ = pure.kvq_attend(q, kv, vv, 0.1, None)
    assert _rel(out, ref) < 1e-3


def _codes_with_row_stride(encoded, extra_words: int):
    """The same Encoded whose packed codes rows are ``extra_words`` longer in memory (a view that drops them):
    rows no longer start on a 16-byte boundary, so the tensor-core kernel must take its word-by-word loads."""
    from kvq.encoded import Encoded

    codes = encoded.data["codes"]
    pad = mx.zeros(codes.shape[:-1] + (extra_words,), codes.dtype)
    wide = mx.concatenate([codes, pad], axis=-1)
    mx.eval(wide)
    return Encoded(encoded.params, {**encoded.data, "codes": wide[..., : codes.shape[-1]]}, encoded.head_dim)


def _kernel_against_pure(method, params, B, T, seed, views):
    """Keys and values of ``B`` rows x 8 KV heads x ``T`` tokens (head_dim 128) encoded by pure MLX, and 32 decode
    queries: for each ``views(keys, values)`` pair of Encoded, the kernel implementation's attention over it
    equals pure MLX's over the encodings as made (within 1e-3, output and log-sum-exp)."""
    kernel, pure = _impl(method)
    p = kvq.make_params(method, **params)
    k, v = _normal((B, 8, T, 128), seed=seed), _normal((B, 8, T, 128), seed=seed + 1)
    q = _normal((B, 32, 1, 128), seed=seed + 2)
    ke, ve = pure.kvq_quantize(k, p), pure.kvq_quantize(v, p)
    ref, ref_lse = pure.kvq_attend(q, ke, ve, 0.1, None)
    for kk, vv in views(ke, ve):
        out, lse = kernel.kvq_attend(q, kk, vv, 0.1, None)
        assert _rel(out, ref) < 1e-3, (method, params)
        assert float(mx.max(mx.abs(lse - ref_lse))) < 1e-3, (method, params)


@pytest.mark.parametrize("rep", [True, False], ids=["tables_per_lane", "shared_tables"])
def test_decode_attend_unaligned_rows_and_table_layouts(rep):
    """Rows of codes 17 words apart (no vector loads), 3 batch rows x 8 KV heads (24 split counters), and both
    table layouts (one copy per lane, or one shared copy) give pure MLX's attention."""
    from kvq_metal import attend

    if kvq_metal.gpu_backend() != "cuda":
        pytest.skip("the tensor-core kernel exists on CUDA only")
    saved = attend.TUNING
    attend.TUNING = attrs.evolve(saved, rep=rep)
    try:
        for method, params in (("turboquant", {"bits": 4}), ("affine", {"bits": 4, "group_size": 64})):
            _kernel_against_pure(method, params, 3, 2000, 31, lambda ke, ve: (
                (ke, ve), (_codes_with_row_stride(ke, 1), _codes_with_row_stride(ve, 1))))
    finally:
        attend.TUNING = saved


def test_decode_attend_reads_views_with_negative_token_strides():
    """Every field's tokens reversed through a view (a negative stride along the token axis): the kernel reads the
    view in place on its general path (64-bit offsets: the path with 32-bit offsets within a row takes strides of no
    sign only) and gives pure MLX's attention over the tokens in their order (a decode query sees every token, so
    the order does not change the result)."""
    def reverse(a):
        return a[:, :, ::-1]

    for method, params in (("turboquant", {"bits": 4}), ("turboquant", {"bits": 3}),
                           ("affine", {"bits": 4, "group_size": 64})):
        _kernel_against_pure(method, params, 2, 1500, 41, lambda ke, ve: ((ke.map(reverse), ve.map(reverse)),))


def test_decode_attend_calls_evaluated_together_stay_independent():
    """Eight attention calls in one graph (MLX may run them concurrently): each has its own split counters, so
    each equals the same call evaluated alone."""
    kernel, pure = _impl("turboquant")
    p = kvq.make_params("turboquant", bits=4)
    encs = [(pure.kvq_quantize(_normal((1, 8, 4096, 128), seed=40 + i), p),
             pure.kvq_quantize(_normal((1, 8, 4096, 128), seed=50 + i), p)) for i in range(8)]
    qs = [_normal((1, 32, 1, 128), seed=60 + i) for i in range(8)]
    together = [kernel.kvq_attend(q, ke, ve, 0.1, None)[0] for q, (ke, ve) in zip(qs, encs)]
    mx.eval(together)
    for q, (ke, ve), got in zip(qs, encs, together):
        alone = kernel.kvq_attend(q, ke, ve, 0.1, None)[0]
        assert _rel(got, alone) < 1e-6


DENSE_CASES = [
    # method, params, head_dim, n_rep, sinks, window, dtype[, the window a transposed view: read element-wise]
    ("turboquant", {"bits": 4}, 128, 4, 4, 140, mx.bfloat16),
    ("turboquant", {"bits": 4}, 128, 4, 4, 37, mx.float16, True),
    ("turboquant", {"bits": 3}, 120, 4, 0, 33, mx.float16),  # rows shorter than the codes' 128 coordinates
    ("affine", {"bits": 4, "group_size": 64}, 128, 8, 4, 128, mx.float16),
    ("turboquant_rvq", {"bits": 2, "residual_bits": 2}, 64, 2, 4, 1, mx.float32),
]


@pytest.mark.parametrize("case", range(len(DENSE_CASES)))
def test_attend_dense_matches_parts(case, attend_tc_knobs):
    """The tensor-core kernel's one-call attention over compressed tokens plus a cache's sinks and window
    (``attend_dense``) equals attending the three parts separately and merging them (pure MLX): float16 and
    bfloat16 rows read with vector loads, rows shorter than the codes' dimension, float32 rows and a strided
    window read element by element."""
    from kvq.attention import DenseTokens, dense_attend, merge_parts

    if kvq_metal.gpu_backend() != "cuda":
        pytest.skip("attend_dense is served by the tensor-core kernel (CUDA)")
    method, params, D, n_rep, n_sinks, n_window, dtype, *transposed = DENSE_CASES[case]
    kernel, pure = _impl(method)
    p = kvq.make_params(method, **params)
    Hkv, T = 2, 3000
    k, v = _normal((1, Hkv, T, D), dtype, 21), _normal((1, Hkv, T, D), dtype, 22)
    q = _normal((1, Hkv * n_rep, 1, D), dtype, 23)
    sk, sv = (_normal((1, Hkv, n_sinks, D), dtype, 24), _normal((1, Hkv, n_sinks, D), dtype, 25)) if n_sinks \
        else (None, None)
    wk, wv = _normal((1, Hkv, n_window, D), dtype, 26, 2.0), _normal((1, Hkv, n_window, D), dtype, 27)
    if transposed:  # the same values, stored [.., D, T]: the kernel gets a view with strides (.., 1, T)
        wk, wv = (mx.swapaxes(mx.contiguous(mx.swapaxes(x, 2, 3)), 2, 3) for x in (wk, wv))
        mx.eval(wk, wv)
    ke, ve = pure.kvq_quantize(k, p), pure.kvq_quantize(v, p)
    scale = D ** -0.5
    got = kernel.attend_dense(q, ke, ve, scale, DenseTokens(sk, sv, wk, wv))
    assert got is not None
    parts = [pure.kvq_attend(q, ke, ve, scale, None), dense_attend(q, wk, wv, scale, None)]
    if n_sinks:
        parts.append(dense_attend(q, sk, sv, scale, None))
    ref, ref_lse = merge_parts(parts)
    assert got[0].shape == ref.shape
    assert _rel(got[0], ref) < 1e-3
    assert float(mx.max(mx.abs(got[1] - ref_lse))) < 1e-3


@pytest.mark.parametrize("case", range(len(DENSE_CASES)))
def test_bound_decode_steps_equal_the_unbound_call(case, attend_tc_knobs):
    """A bound decode step (``bind_dense``: one launch that attends the codes, sinks and window, writes the output in
    the queries' dtype and zeroes the next step's split counters) equals ``attend_dense`` cast to that dtype, for
    eight steps built into one graph (each step's counters come from the step before, nothing evaluated in between)
    over a window that grows by a token each step."""
    from kvq.attention import DenseTokens

    if kvq_metal.gpu_backend() != "cuda":
        pytest.skip("decode steps are bound for the tensor-core kernel (CUDA)")
    method, params, D, n_rep, n_sinks, n_window, dtype, *transposed = DENSE_CASES[case]
    kernel, pure = _impl(method)
    p = kvq.make_params(method, **params)
    Hkv = 2
    ke, ve = (pure.kvq_quantize(_normal((1, Hkv, 2000, D), dtype, s), p) for s in (31, 32))
    sk, sv = (_normal((1, Hkv, n_sinks, D), dtype, 33), _normal((1, Hkv, n_sinks, D), dtype, 34)) if n_sinks \
        else (None, None)
    wk, wv = _normal((1, Hkv, n_window + 8, D), dtype, 35, 2.0), _normal((1, Hkv, n_window + 8, D), dtype, 36)
    qs = [_normal((1, Hkv * n_rep, 1, D), dtype, 40 + i) for i in range(8)]
    step = kernel.bind_dense(qs[0], ke, ve, D ** -0.5, sk, sv, wk[:, :, :n_window], wv[:, :, :n_window])
    assert step is not None
    outs = [step(q, wk[:, :, :n_window + i], wv[:, :, :n_window + i]) for i, q in enumerate(qs)]
    mx.eval(outs)
    for i, (q, out) in enumerate(zip(qs, outs)):
        want = kernel.attend_dense(q, ke, ve, D ** -0.5, DenseTokens(sk, sv, wk[:, :, :n_window + i],
                                                                      wv[:, :, :n_window + i]))[0]
        assert out.dtype == dtype and out.shape == want.shape
        assert _rel(out, want.astype(dtype)) < 1e-6, i


@pytest.mark.parametrize("bits", [3, 4])
def test_bound_decode_step_of_a_wide_batch(bits):
    """A batch whose rows alone fill the tensor-core kernel's split target (``B * H_kv >= tc_groups``: 34 rows x 8
    KV heads) is launched with the wide launch bound (``AttendKnobs.minb_wide``: the compiler fits the registers to
    that many blocks per SM; :func:`kvq_metal.attend_tc.minb`), and its bound decode steps give the attention of the
    parts computed apart by pure MLX (codes, sinks, a window that grows by a token each step)."""
    from kvq.attention import dense_attend, merge_parts
    from kvq_metal import attend

    if kvq_metal.gpu_backend() != "cuda":
        pytest.skip("decode steps are bound for the tensor-core kernel (CUDA)")
    B, Hkv, n_rep, D, dtype = attend.TUNING.tc_groups // 8 + 1, 8, 4, 128, mx.bfloat16
    kernel, pure = _impl("turboquant")
    p = kvq.make_params("turboquant", bits=bits)
    ke, ve = (pure.kvq_quantize(_normal((B, Hkv, 600, D), dtype, s), p) for s in (61, 62))
    sk, sv = _normal((B, Hkv, 4, D), dtype, 63), _normal((B, Hkv, 4, D), dtype, 64)
    wk, wv = _normal((B, Hkv, 40, D), dtype, 65, 2.0), _normal((B, Hkv, 40, D), dtype, 66)
    qs = [_normal((B, Hkv * n_rep, 1, D), dtype, 70 + i) for i in range(3)]
    step = kernel.bind_dense(qs[0], ke, ve, D ** -0.5, sk, sv, wk[:, :, :32], wv[:, :, :32])
    assert step is not None
    assert attend.TUNING.minb_wide > 0 and dict(step.template_args)["MINB"] == attend.TUNING.minb_wide
    outs = [step(q, wk[:, :, :32 + i], wv[:, :, :32 + i]) for i, q in enumerate(qs)]
    mx.eval(outs)
    scale = D ** -0.5
    for i, (q, out) in enumerate(zip(qs, outs)):
        ref, _ = merge_parts([pure.kvq_attend(q, ke, ve, scale, None), dense_attend(q, sk, sv, scale, None),
                              dense_attend(q, wk[:, :, :32 + i], wv[:, :, :32 + i], scale, None)])
        assert out.shape == ref.shape and out.dtype == dtype
        assert _rel(out, ref) < 4e-3, i  # bfloat16 outputs


@pytest.mark.parametrize("method,params", [("turboquant", {"bits": 3}), ("turboquant", {"bits": 4}),
                                           ("affine", {"bits": 4})])
def test_cache_decode_through_the_bound_step_matches_kernels_off(method, params):
    """A KVQCache decoding token by token on the GPU (the bound step, rebound at every window flush) gives the
    attention of the same cache with kernels off (pure MLX, the parts merged) within 2e-3 relative, bfloat16."""
    if kvq_metal.gpu_backend() != "cuda":
        pytest.skip("decode steps are bound for the tensor-core kernel (CUDA)")
    from kvq.cache import KVQCache, make_config

    caches = [KVQCache(make_config(method, **params, window=32, flush=8, kernels=k)) for k in ("auto", "off")]
    k, v = _normal((1, 8, 600, 128), mx.bfloat16, 51), _normal((1, 8, 600, 128), mx.bfloat16, 52)
    for c in caches:
        c.update_and_fetch(k[:, :, :500], v[:, :, :500])
    binds = []  # the bound steps (kept alive, so their ids stay distinct)
    for t in range(500, 540):
        q = _normal((1, 32, 1, 128), mx.bfloat16, t)
        got, want = [(c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1]), c.attend(q, 128 ** -0.5))[1]
                     for c in caches]
        assert got.dtype == mx.bfloat16 and _rel(got, want) < 2e-3, t
        binds.append(caches[0]._bound[2])
    assert len({id(b) for b in binds}) == 6  # the first step, then one binding per flush of 8 tokens (40 steps)


@pytest.mark.parametrize("method,params", [("turboquant", {"bits": 3}), ("turboquant", {"bits": 4}),
                                           ("affine", {"bits": 4})])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_packed_batch_decode_in_one_launch_matches_rows(method, params, D):
    """A BatchKVQCache of three sequences of different lengths (so different compressed and window counts, flushing
    at different steps; one with no compressed token until its first compression, in the pack) decodes packed
    through the ragged tensor-core step (one launch for all rows; checked: the binding is a ragged DecodeStep) and
    gives each row the attention of the same rows decoding one by one through their own bound steps (the same
    codes; only the split boundaries differ) within 2e-3 relative (bfloat16 outputs of float32 sums split
    differently: at 14db2f6 the fresh row's attention, over its window alone, parted by one bfloat16 ulp in a few
    elements, 1.02e-3 at head_dim 128), and with kernels off (pure MLX: float32 decoding, the pure-MLX encoder)
    within 4e-3 per row and over the batch (the batch's relative error is at most its rows'; measured on the H200
    at d31e80f: 3.35e-3 for 3-bit keys at head_dim 128, step 18, two bfloat16 ulps of an element of 0.12 against
    the batch's largest, 0.29: the kernel decodes to fp16 and multiplies fp16 probabilities, pure MLX stays in
    float32), bfloat16, GQA 4."""
    if kvq_metal.gpu_backend() != "cuda":
        pytest.skip("ragged decode steps are bound for the tensor-core kernel (CUDA)")
    from kvq.cache import BatchKVQCache, KVQCache, make_config
    from kvq_metal.step import DecodeStep

    lengths = (300, 517, 25)  # the 25-token row has compressed nothing: its first compression comes at step 19
    batches = []
    for kernels in ("auto", "auto", "off"):
        rows = []
        for i, n in enumerate(lengths):
            row = KVQCache(make_config(method, **params, window=32, flush=8, kernels=kernels))
            row.update_and_fetch(_normal((1, 4, n, D), mx.bfloat16, 60 + i), _normal((1, 4, n, D), mx.bfloat16, 70 + i))
            row.release_chunk()
            rows.append(row)
        batches.append(BatchKVQCache(rows))
    batches[1].pack = batches[2].pack = False
    binds = []  # the bound steps (kept alive, so their ids stay distinct)
    rebinds = []  # the steps where the packed arrays were replaced (more capacity) or a first compression joined
    for t in range(20):
        k, v = _normal((3, 4, 1, D), mx.bfloat16, 100 + t), _normal((3, 4, 1, D), mx.bfloat16, 200 + t)
        q = _normal((3, 16, 1, D), mx.bfloat16, 300 + t)
        before = (batches[0]._packed.capacity, batches[0]._packed.compressed[2]) if batches[0].packed else None
        got, rows, want = [(b.update_and_fetch(k, v), b.attend(q, D ** -0.5))[1] for b in batches]
        assert got.dtype == mx.bfloat16
        for r in range(3):
            assert _rel(got[r:r + 1], rows[r:r + 1]) < 2e-3, (t, r)
            assert _rel(got[r:r + 1], want[r:r + 1]) < 4e-3, (t, r)
        assert _rel(got, want) < 4e-3, t
        binds.append(batches[0]._packed._bound[1])
        assert isinstance(binds[-1], DecodeStep) and binds[-1].ragged
        after = (batches[0]._packed.capacity, min(batches[0]._packed.compressed[2], 1))
        if before is None or before[0] != after[0] or min(before[1], 1) != after[1]:
            rebinds.append(t)
    # bound at the first step and again only where the arrays changed (issue #52: a flush writes into them in
    # place and keeps the binding; the two long rows flush at t = 6, 7, 14 and 15, the 25-token row makes its
    # first compression at t = 18: bound at 0 and 18, on the CPU with a stand-in binding)
    changed = [t for t in range(20) if t == 0 or binds[t] is not binds[t - 1]]
    assert batches[0].packed and changed == rebinds and 18 in changed


# -- fused TurboQuant encode / decode ---------------------------------------------------------------------
# head_dims below their power-of-two rotation size (120 and 240; 112 at 1 bit); 80, 96, 192 rotate unpadded, which
# the fused kernels leave to pure MLX (tests/test_turboquant_dims.py)
CODEC_CASES = [(64, 1, mx.float16), (120, 2, mx.bfloat16), (112, 1, mx.float32), (128, 4, mx.float16),
               (128, 3, mx.bfloat16), (128, 2, mx.float32), (128, 1, mx.float16), (240, 4, mx.float16),
               (256, 4, mx.bfloat16), (256, 1, mx.float32), (32, 3, mx.float16)]


@pytest.mark.parametrize("D,bits,dtype", CODEC_CASES)
def test_turboquant_codec_matches_pure_mlx(D, bits, dtype):
    kernel, pure = _impl("turboquant")
    p = kvq.make_params("turboquant", bits=bits)
    x = _normal((2, 3, 257, D), dtype, seed=D + bits, scale=2.0)
    got, want = kernel.kvq_quantize(x, p), pure.kvq_quantize(x, p)
    assert got.data["codes"].shape == want.data["codes"].shape
    assert got.data["norms"].dtype == want.data["norms"].dtype
    dim = got.data["codes"].shape[-1] * 32 // bits
    assert code_mismatch(got.data["codes"], want.data["codes"], bits, dim) <= 1e-3
    assert _rel(got.data["norms"], want.data["norms"]) < 1e-3
    err_k = float(mx.mean((pure.kvq_dequantize(got, mx.float32) - x.astype(mx.float32)) ** 2))
    err_p = float(mx.mean((pure.kvq_dequantize(want, mx.float32) - x.astype(mx.float32)) ** 2))
    assert abs(err_k - err_p) <= 0.01 * err_p
    assert _rel(kernel.kvq_dequantize(want, dtype), pure.kvq_dequantize(want, dtype)) < 1e-3


def _decoded_into(kernel, enc, dtype, before: int, after: int):
    """``(encoded, the decoded columns of kernel.dequantize_into)`` for ``enc`` and for ``enc`` stored as a slice of
    a larger store (a cache's codes within its capacity step), the output's shape and dtype checked."""
    sliced = attrs.evolve(enc, data={k: v[:, :, :257] for k, v in enc.data.items()})
    for e in (enc, sliced):
        B, H, T, D = e.shape
        got = kernel.dequantize_into(e, dtype, before, after)
        assert got.shape == (B, H, before + T + after, D) and got.dtype == dtype
        yield e, got[:, :, before:before + T]


@pytest.mark.parametrize("D,bits,dtype", [(128, 3, mx.bfloat16), (64, 1, mx.float16), (120, 2, mx.bfloat16),
                                          (256, 4, mx.float16)])
@pytest.mark.parametrize("before,after", [(0, 0), (4, 130), (0, 7), (3, 0)])
def test_turboquant_decode_into_wider_columns_is_the_decode(D, bits, dtype, before, after):
    """Issue #51: :meth:`dequantize_into` writes each row's decoded tokens between ``before`` and ``after``
    columns, bit for bit what ``kvq_dequantize`` gives, for codes stored contiguously and as a slice of a larger
    store (a cache's codes beyond its capacity step); the columns around them are left to the caller."""
    kernel, pure = _impl("turboquant")
    p = kvq.make_params("turboquant", bits=bits)
    enc = pure.kvq_quantize(_normal((2, 3, 300, D), dtype, seed=D + bits, scale=2.0), p)
    for e, got in _decoded_into(kernel, enc, dtype, before, after):
        want = kernel.kvq_dequantize(e, dtype)
        assert mx.array_equal(got, want)
        assert _rel(want, pure.kvq_dequantize(e, dtype)) < 1e-3


@pytest.mark.parametrize("D,bits,group,dtype", [(128, 4, 64, mx.bfloat16), (64, 3, 32, mx.float16),
                                                (256, 8, 128, mx.float32), (128, 6, 64, mx.bfloat16),
                                                (32, 2, 32, mx.float16)])
@pytest.mark.parametrize("before,after", [(0, 0), (4, 130)])
def test_affine_decode_into_wider_columns_is_mlx_dequantize(D, bits, group, dtype, before, after):
    """Issue #51: affine's kernel decode (:meth:`AffineKernels.dequantize_into`) writes each row's tokens between
    ``before`` and ``after`` columns, within one rounding of ``dtype`` of ``mx.dequantize`` (which rounds to the
    scales' float16 first), NaN where a group's scale is, for codes stored contiguously and as a slice of a larger
    store."""
    kernel, pure = _impl("affine")
    p = kvq.make_params("affine", bits=bits, group_size=group)
    x = _normal((2, 3, 300, D), mx.float16, seed=D + bits, scale=2.0)
    x[0, 1, 7, 3] = mx.nan
    enc = pure.kvq_quantize(x, p)
    for e, got in _decoded_into(kernel, enc, dtype, before, after):
        want = pure.kvq_dequantize(e, dtype)
        assert mx.array_equal(mx.isnan(got), mx.isnan(want))
        assert int(mx.isnan(want).sum()) == group
        a, b = mx.nan_to_num(got.astype(mx.float32)), mx.nan_to_num(want.astype(mx.float32))
        tol = {mx.float32: 1e-3, mx.float16: 4e-3, mx.bfloat16: 8e-3}[dtype]
        assert float(mx.max(mx.abs(a - b) / (mx.abs(b) + 1e-3))) < tol


# -- fused encoders of qjl and turboquant_prod (issue #21: a window flush quantizes in one launch per side) ------
QJL_ENCODER_CASES = [(64, {}, mx.float16), (128, {}, mx.bfloat16), (128, {"outlier_channels": 0}, mx.float32),
                     (256, {"sketch_dim": 96, "outlier_channels": 8}, mx.bfloat16),
                     (96, {"group_size": 16, "outlier_channels": 2}, mx.float16)]


@pytest.mark.parametrize("D,overrides,dtype", QJL_ENCODER_CASES)
def test_qjl_fused_encoder_matches_pure_mlx(D, overrides, dtype):
    from kvq_backends_qjl.signs import unpack_bits

    kernel, pure = _impl("qjl")
    p = kvq.make_params("qjl", **overrides)
    boost = np.where(np.arange(D) % 29 == 3, 8.0, 1.0).astype(np.float32)  # a few channels of large energy
    x = (_normal((2, 3, 77, D), mx.float32, seed=D) * mx.array(boost)).astype(dtype)  # 77: two groups and a part
    got, want = kernel.kvq_quantize(x, p), pure.kvq_quantize(x, p)
    assert set(got.data) == set(want.data)
    for name, a in got.data.items():
        b = want.data[name]
        assert (a.shape, a.dtype) == (b.shape, b.dtype), name
        if name == "outlier_indices":
            assert mx.array_equal(a, b)
        elif name.endswith("signs"):
            assert float(mx.mean(unpack_bits(a) != unpack_bits(b))) <= 1e-3, name
        else:
            assert _rel(a, b) < 1e-3, name
    assert _rel(pure.kvq_dequantize(got, mx.float32), pure.kvq_dequantize(want, mx.float32)) < 1e-2  # estimates


def test_qjl_fused_encoder_non_finite_key_gets_nan_norms():
    kernel, pure = _impl("qjl")
    p = kvq.make_params("qjl")
    x = np.asarray(_normal((1, 2, 40, 128), mx.float32, seed=3))
    x[0, 1, 5, 17] = np.nan
    x[0, 0, 33, 2] = np.inf
    x = mx.array(x)
    got, want = kernel.kvq_quantize(x, p), pure.kvq_quantize(x, p)
    for name in ("norms", "outlier_norms"):
        g, w = np.asarray(got.data[name].astype(mx.float32)), np.asarray(want.data[name].astype(mx.float32))
        assert np.array_equal(np.isnan(g), np.isnan(w)) and np.isnan(g).sum() == 2, name
        assert np.allclose(g[~np.isnan(g)], w[~np.isnan(w)], rtol=1e-3), name
    assert mx.array_equal(got.data["outlier_indices"], want.data["outlier_indices"])  # bad coordinates count as 0


PROD_ENCODER_CASES = [(64, 2, mx.float16), (128, 3, mx.bfloat16), (128, 4, mx.float32), (256, 4, mx.bfloat16),
                      (32, 2, mx.float16), (120, 3, mx.float16)]  # 120 rotates zero-padded to 128


@pytest.mark.parametrize("D,bits,dtype", PROD_ENCODER_CASES)
def test_turboquant_prod_fused_encoder_matches_pure_mlx(D, bits, dtype):
    kernel, pure = _impl("turboquant_prod")
    p = kvq.make_params("turboquant_prod", bits=bits)
    x = _normal((2, 3, 257, D), dtype, seed=D + bits, scale=2.0)
    got, want = kernel.kvq_quantize(x, p), pure.kvq_quantize(x, p)
    assert set(got.data) == set(want.data) == {"codes", "norms", "signs", "residual_norms"}
    for name, a in got.data.items():
        assert (a.shape, a.dtype) == (want.data[name].shape, want.data[name].dtype), name
    dim = p.rotated_dim(D)
    assert code_mismatch(got.data["codes"], want.data["codes"], bits - 1, dim) <= 1e-3
    assert code_mismatch(got.data["signs"], want.data["signs"], 1, dim) <= 1e-3
    assert _rel(got.data["norms"], want.data["norms"]) < 1e-3
    assert _rel(got.data["residual_norms"], want.data["residual_norms"]) < 1e-3
    assert _rel(pure.kvq_dequantize(got, mx.float32), pure.kvq_dequantize(want, mx.float32)) < 1e-2


def test_selection_takes_the_fused_encoders_for_a_flush():
    backend = kvq_metal.gpu_backend()
    for method, params in (("qjl", {}), ("turboquant_prod", {"bits": 4})):
        plan = kvq.select(method, (1, 8, 32, 128), dtype=mx.bfloat16, op="quantize",
                          params=kvq.make_params(method, **params))
        assert plan.choices["quantize"].backend == backend, plan.explain()
    assert all(passed for passed, _ in kvq_metal.base.CHECKS.values()), kvq_metal.base.CHECKS


def test_turboquant_large_norms_saturate_like_pure_mlx():
    kernel, pure = _impl("turboquant")
    p = kvq.make_params("turboquant", bits=4)
    x = _normal((1, 1, 64, 128), mx.float32, 7, scale=1e4)  # norms ~1.1e5, beyond float16
    got, want = kernel.kvq_quantize(x, p), pure.kvq_quantize(x, p)
    assert mx.array_equal(got.data["norms"], want.data["norms"])
    assert float(mx.max(got.data["norms"].astype(mx.float32))) == 65504.0


def test_turboquant_quantize_intermediate_memory_under_16mb():
    """Issue #8: head_dim 256, 4096 tokens (8 KV heads): the fused encoder allocates nothing but its outputs."""
    kernel, pure = _impl("turboquant")
    p = kvq.make_params("turboquant", bits=4)
    x = _normal((1, 8, 4096, 256), mx.float16, 8)
    mx.eval(x)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    enc = kernel.kvq_quantize(x, p)
    mx.eval(enc.data)
    intermediate = mx.get_peak_memory() - base - enc.nbytes
    assert intermediate < 16 * 2**20, intermediate
    del enc
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    enc = pure.kvq_quantize(x, p)
    mx.eval(enc.data)
    assert mx.get_peak_memory() - base - enc.nbytes > 10 * intermediate  # what the kernel saves


# -- non-finite input (kvq.contract.Quantizes) -----------------------------------------------------------
NON_FINITE_CASES = [("turboquant", {"bits": 4}), ("turboquant", {"bits": 3, "norm_dtype": "float32"}),
                    ("affine", {"bits": 4, "group_size": 64}), ("turboquant_rvq", {"bits": 2, "residual_bits": 2})]


def _with_non_finite(x: mx.array, token: int) -> mx.array:
    """``x`` with a NaN and a +inf in ``token`` of KV head 0 (coordinates 5 and 20: one affine group) and a -inf
    alone in ``token + 5``."""
    a = np.array(x.astype(mx.float32))
    a[0, 0, token, 5], a[0, 0, token, 20], a[0, 0, token + 5, 7] = np.nan, np.inf, -np.inf
    return mx.array(a).astype(x.dtype)


@pytest.mark.parametrize("method,params", NON_FINITE_CASES)
def test_non_finite_token_like_pure_mlx(method, params, attend_kernel_kind):
    """The kernels follow kvq's non-finite policy as pure MLX does: the fused encoder stores a NaN norm (float16
    norms too, which saturate at 65504 otherwise), the fused decoder gives NaN for that token, and decode
    attention (also with sinks and window in one call) is NaN for the queries of that KV head and matches pure
    MLX for the other head."""
    from kvq.attention import DenseTokens

    kernel, pure = _impl(method)
    p = kvq.make_params(method, **params)
    D, T, n_rep = 128, 700, 4
    k, v = _normal((1, 2, T, D), seed=71), _normal((1, 2, T, D), seed=72)
    q = _normal((1, 2 * n_rep, 1, D), seed=73)
    k_bad, v_bad = _with_non_finite(k, 300), _with_non_finite(v, 301)
    if hasattr(kernel, "kvq_quantize"):
        got, want = kernel.kvq_quantize(k_bad, p), pure.kvq_quantize(k_bad, p)
        norms = "norms" if "norms" in want.data else "scales"
        assert mx.array_equal(mx.isnan(got.data[norms]), mx.isnan(want.data[norms])).item()
        assert np.flatnonzero(np.isnan(np.array(got.data[norms][0, 0]))).tolist() == [300, 305]  # those tokens only
        assert not mx.any(mx.isnan(got.data[norms][0, 1])).item()
    if hasattr(kernel, "kvq_dequantize"):
        decoded = kernel.kvq_dequantize(pure.kvq_quantize(k_bad, p), mx.float32)
        assert mx.array_equal(mx.isnan(decoded), mx.isnan(pure.kvq_dequantize(pure.kvq_quantize(k_bad, p),
                                                                                mx.float32))).item()
    ke, ve, ke_bad, ve_bad = (pure.kvq_quantize(x, p) for x in (k, v, k_bad, v_bad))
    dense = DenseTokens(_normal((1, 2, 4, D), seed=74), _normal((1, 2, 4, D), seed=75),
                        _normal((1, 2, 40, D), seed=76), _normal((1, 2, 40, D), seed=77))
    for keys, values in ((ke_bad, ve), (ke, ve_bad)):
        ref = np.array(pure.kvq_attend(q, keys, values, D ** -0.5, None)[0])
        calls = [kernel.kvq_attend(q, keys, values, D ** -0.5, None)[0]]
        if kvq_metal.gpu_backend() == "cuda":
            calls.append(kernel.attend_dense(q, keys, values, D ** -0.5, dense))
        for out in calls:
            if out is None:  # attend_dense declined this call: the cache attends the parts (pure MLX's path)
                continue
            out = np.array(out[0] if isinstance(out, tuple) else out)
            assert np.array_equal(np.isnan(out[:, :n_rep]), np.isnan(ref[:, :n_rep]))
            assert np.isnan(out[:, :n_rep]).any(axis=-1).all()  # every query of KV head 0
            assert np.isfinite(out[:, n_rep:]).all()
        assert _rel(mx.array(np.array(calls[0])[:, n_rep:]), mx.array(ref[:, n_rep:])) < 1e-3


# -- selection, first-use check, and the cache ------------------------------------------------------------
def test_selection_prefers_the_kernel_at_long_context():
    backend = kvq_metal.gpu_backend()
    for method in ("affine", "turboquant", "turboquant_rvq"):
        plan = kvq.select(method, (1, 8, 65536, 128), op="attend", num_q_heads=32)
        assert plan.choices["attend"].backend == backend, plan.explain()
    plan = kvq.select("turboquant", (1, 8, 65536, 128), op="quantize")
    assert plan.choices["quantize"].backend == backend, plan.explain()
    failed = {entry: detail for entry, (passed, detail) in kvq_metal.base.CHECKS.items() if not passed}
    assert not failed, failed


def test_failed_first_use_check_disables_with_a_warning(monkeypatch):
    from kvq_metal import base
    from kvq_metal.base import KernelDisabledWarning, first_use_check

    monkeypatch.setattr(base, "CHECKS", dict(base.CHECKS))  # the fake kernel's failure leaves no trace for later tests

    with pytest.warns(KernelDisabledWarning, match="fake_kernel"):
        assert not first_use_check("cuda", "fake_kernel", (1,), lambda: (False, "mismatch 0.5"))
    assert not first_use_check("cuda", "fake_kernel", (1,), lambda: (True, ""))  # remembered


#: A top-2 log-probability gap (nats) below which greedy decoding is at a near-tie: the kernels' fp16 arithmetic
#: (attention within 2e-3 relative of pure MLX's float32) may pick the other token there.
NEAR_TIE = 0.05


def greedy_with_margins(model, prompt, cache, n: int) -> list[tuple[int, float]]:
    """``n`` greedy tokens through ``cache``, each with its top-2 log-probability gap."""
    from mlx_lm.generate import generate_step

    out = []
    for (t, logprobs), _ in zip(generate_step(prompt, model, prompt_cache=cache, max_tokens=n), range(n)):
        top = np.sort(np.asarray(logprobs.astype(mx.float32)))[-2:]
        out.append((int(t), float(top[1] - top[0])))
    return out


def first_divergence(ours: list, reference: list) -> str | None:
    """Where greedy tokens first differ from the reference's, unless the reference was at a near-tie there
    (:data:`NEAR_TIE`; after that the two runs decode different tokens, so nothing further compares): ``None``
    when they agree."""
    for i, ((a, _), (b, gap)) in enumerate(zip(ours, reference)):
        if a != b:
            return None if gap < NEAR_TIE else f"token {i}: {a} != {b}, where pure MLX's top-2 gap is {gap:.3f}"
    return None


@pytest.mark.parametrize("method,params", [("turboquant", {"bits": 4}), ("turboquant", {"bits": 3}),
                                           ("affine", {"bits": 4}), ("affine", {"bits": 8}),
                                           ("turboquant_rvq", {"bits": 2, "residual_bits": 1}),
                                           ("turboquant_rvq", {"bits": 2, "residual_bits": 2})])
def test_cache_tokens_with_kernels_auto_equal_off(method, params):
    """Issue #11: kernels="auto" and kernels="off" give the same greedy tokens through the cache, up to a near-tie
    of pure MLX's (top-2 log-probabilities within NEAR_TIE) where they part; "require" constructs on a GPU. This
    random fp16 model has ties: with turboquant:4, pure MLX's own run (measured on the CPU) has a top-2 gap of
    exactly 0 at tokens 11 and 19 of 24 (equal fp16 logits), and token 19 is where the kernels' run parted from it
    on the H200 when this test asked for equal tokens throughout (at fad43c7 and 2b46701)."""
    from conftest import tiny_llama

    model = tiny_llama(hidden=512, layers=2, heads=8, kv_heads=2, vocab=512, dtype=mx.float16, seed=11)
    prompt = mx.array(np.random.default_rng(0).integers(0, 512, 700))

    def tokens(kernels):
        cache = kvq.make_prompt_cache(model, method, window=32, sinks=4, kernels=kernels, **params)
        return greedy_with_margins(model, prompt, cache, 24)

    reference = tokens("off")
    assert first_divergence(tokens("auto"), reference) is None
    assert first_divergence(tokens("require"), reference) is None


# -- the streams kernel: qjl keys, turboquant_prod, vecinfer (issue #21) ------------------------------------
STREAM_CASES = [
    # key method, key params, value method, value params, head_dim, n_rep, T_q, T
    ("qjl", {}, "affine", {"bits": 4}, 128, 4, 1, 5000),
    ("qjl", {}, "affine", {"bits": 4}, 128, 4, 2, 300),
    ("qjl", {"outlier_channels": 0}, "affine", {"bits": 2, "group_size": 32}, 64, 8, 1, 257),
    ("qjl", {"outlier_channels": 8, "sketch_dim": 256}, "affine", {"bits": 4, "group_size": 64}, 256, 2, 1, 1000),
    ("qjl", {"sketch_dim": 96}, "affine", {"bits": 4}, 64, 1, 2, 700),
    ("turboquant_prod", {"bits": 4}, "turboquant_prod", {"bits": 4}, 128, 4, 1, 5000),
    ("turboquant_prod", {"bits": 3}, "turboquant_prod", {"bits": 3}, 128, 2, 2, 300),
    ("turboquant_prod", {"bits": 2}, "turboquant", {"bits": 2}, 64, 8, 1, 129),
    ("turboquant_prod", {"bits": 4, "norm_dtype": "float32"}, "turboquant_prod", {"bits": 4}, 256, 2, 1, 1000),
    ("turboquant_prod", {"bits": 3}, "turboquant_prod", {"bits": 3}, 96, 1, 2, 777),
]


#: The tensor-core streams kernel's launch knobs apart from the default (query fragments in shared memory, no
#: prefetch, one tile per warp step): ``tc_regs`` the fragments in registers, prefetch where it fits, two tiles;
#: ``tc_single`` single code tables (``kvq_metal.streams.TUNING``).
STREAMS_TC_VARIANTS = {"tc_regs": {"qsh": False, "pf": None, "nt": 2}, "tc_single": {"rep": False}}


@pytest.fixture(params=[True, False, "tc_regs", "tc_single"], ids=["tensor_cores", "simt", "tc_regs", "tc_single"])
def streams_kernel_kind(request):
    """Both streams kernels: on CUDA the tensor-core one serves the calls it takes by default
    (:func:`kvq_metal.streams_plan.tc_plan`), ``simt`` forces the SIMT one (the Metal design); ``tc_regs`` and
    ``tc_single`` are the tensor-core kernel with :data:`STREAMS_TC_VARIANTS`, CUDA only."""
    from kvq_metal import streams

    knobs = STREAMS_TC_VARIANTS.get(request.param, {})
    for _ in _knobs(streams, knobs):
        yield from _tensor_cores(True if knobs else request.param, streams)


@pytest.mark.parametrize("case", range(len(STREAM_CASES)))
def test_streams_kernel_matches_pure_mlx(case, streams_kernel_kind):
    """qjl keys with affine values, and turboquant_prod (with prod or mse values): the streams kernel within 1e-3
    relative of pure MLX (head_dim 64/96/128/256, GQA, 1 and 2 query tokens), through a strided view too."""
    km, kp, vm, vp, D, n_rep, Tq, T = STREAM_CASES[case]
    dtype = (mx.float16, mx.bfloat16, mx.float32)[case % 3]
    kernel, pure = _impl(km)
    reg = registry()
    kparams, vparams = kvq.make_params(km, **kp), kvq.make_params(vm, **vp)
    if vm == "affine":
        vparams = vparams.for_head_dim(D)
    Hkv = 2
    k, v = _normal((1, Hkv, T + 40, D), dtype, 1), _normal((1, Hkv, T + 40, D), dtype, 2)
    q = _normal((1, Hkv * n_rep, Tq, D), dtype, 3)
    ke = reg.implementations[(km, "mlx")].kvq_quantize(k, kparams).tokens(0, T)
    ve = reg.implementations[(vm, "mlx")].kvq_quantize(v, vparams).tokens(0, T)
    assert kernel._served_call(q, ke, ve, None) is not None, kvq_metal.base.CHECKS
    out, lse = kernel.kvq_attend(q, ke, ve, D ** -0.5, None)
    ref, ref_lse = pure.kvq_attend(q, ke, ve, D ** -0.5, None)
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    assert _rel(out, ref) < 1e-3, case
    assert float(mx.max(mx.abs(lse - ref_lse))) < 1e-3


@pytest.mark.parametrize("per_head,code_bits,n_rep,Tq", [(False, 8, 4, 1), (True, 6, 2, 2), (False, 4, 8, 1)])
def test_vecinfer_streams_kernel_matches_pure_mlx(per_head, code_bits, n_rep, Tq, tmp_path, monkeypatch):
    """vecinfer: codebooks in shared memory (one per layer or per KV head), within 1e-3 relative of pure MLX; a
    token stored with the reserved pattern (a NaN key) makes the output NaN in both."""
    from kvq_backends_vecinfer import storage

    from test_vecinfer import _calibrated

    monkeypatch.setenv("KVQ_DATA_DIR", str(tmp_path))
    storage.forget()
    try:
        _, kp, vp = _calibrated(per_head=per_head, code_bits=code_bits)
        kp, vp = kp.for_layer(1), vp.for_layer(1)
        kernel, pure = _impl("vecinfer")
        k, v = _normal((1, 2, 1500, 64), mx.float16, 5), _normal((1, 2, 1500, 64), mx.float16, 6)
        q = _normal((1, 2 * n_rep, Tq, 64), mx.float16, 7)
        ke, ve = pure.kvq_quantize(k, kp), pure.kvq_quantize(v, vp)
        assert kernel._served_call(q, ke, ve, None) is not None, kvq_metal.base.CHECKS
        out, lse = kernel.kvq_attend(q, ke, ve, 0.125, None)
        ref, ref_lse = pure.kvq_attend(q, ke, ve, 0.125, None)
        assert _rel(out, ref) < 1e-3 and float(mx.max(mx.abs(lse - ref_lse))) < 1e-3
        bad = k.at[0, 1, 700].add(float("nan"))
        out, _ = kernel.kvq_attend(q, pure.kvq_quantize(bad, kp), ve, 0.125, None)
        ref, _ = pure.kvq_attend(q, pure.kvq_quantize(bad, kp), ve, 0.125, None)
        out, ref = np.asarray(out.astype(mx.float32)), np.asarray(ref.astype(mx.float32))
        assert np.isnan(out[:, n_rep:]).all() and np.isnan(ref[:, n_rep:]).all()
        assert _rel(mx.array(out[:, :n_rep]), mx.array(ref[:, :n_rep])) < 1e-3
    finally:
        storage.forget()


@pytest.mark.parametrize("per_head,sub_dim,code_bits,dtype", [(False, 4, 8, mx.float16), (True, 4, 6, mx.bfloat16),
                                                               (False, 2, 10, mx.float32), (True, 8, 8, mx.float16)])
def test_vecinfer_fused_encoder_matches_pure_mlx(per_head, sub_dim, code_bits, dtype, tmp_path, monkeypatch):
    """vecinfer's fused encoder (``vq_encode.kvq``, issue #21): the codes of keys (smoothed) and values within
    0.5% of pure MLX's (sub-vectors within float rounding of two centroids), the reserved pattern for a token with
    a NaN coordinate, and selection takes it for a 32-token flush."""
    from kvq_backends_vecinfer import storage, vq

    from test_vecinfer import _calibrated

    monkeypatch.setenv("KVQ_DATA_DIR", str(tmp_path))
    storage.forget()
    try:
        _, kp, vp = _calibrated(sub_dim=sub_dim, code_bits=code_bits, per_head=per_head)
        kernel, pure = _impl("vecinfer")
        for params, seed in ((kp.for_layer(1), 51), (vp.for_layer(1), 52)):
            x = _normal((1, 2, 77, 64), dtype, seed).at[0, 1, 9, 5].add(float("nan"))
            got, want = kernel.kvq_quantize(x, params), pure.kvq_quantize(x, params)
            assert got.data["codes"].shape == want.data["codes"].shape
            M = params.sub_vectors(64)
            a, b = (vq.unpack_codes(e.data["codes"], code_bits, M) for e in (got, want))
            assert float(mx.mean(a != b)) <= 5e-3
            assert mx.array_equal(vq.reserved(got.data["codes"], M, code_bits),
                                  vq.reserved(want.data["codes"], M, code_bits))
            assert bool(vq.reserved(got.data["codes"], M, code_bits)[0, 1, 9])
            plan = kvq.select("vecinfer", (1, 2, 32, 64), dtype=dtype, op="quantize", params=params)
            assert plan.choices["quantize"].backend == kvq_metal.gpu_backend(), plan.explain()
    finally:
        storage.forget()


@pytest.mark.parametrize("method,params", [("qjl", {"value_method": "affine", "value_params": {"bits": 4}}),
                                           ("turboquant_prod", {"bits": 4})])
def test_streams_cache_tokens_with_kernels_auto_equal_off(method, params):
    """The cache decodes qjl+affine and turboquant_prod through the streams kernel (selected on the GPU) with the
    greedy tokens of kernels="off"."""
    from mlx_lm.generate import generate_step

    from conftest import tiny_llama

    model = tiny_llama(hidden=512, layers=2, heads=8, kv_heads=2, vocab=512, dtype=mx.float16, seed=11)
    prompt = mx.array(np.random.default_rng(0).integers(0, 512, 700))
    shape = (1, 2, 700, 64)
    plan = kvq.select(method, shape, op="attend", num_q_heads=8, kernels="require")
    assert plan.choices["attend"].backend == kvq_metal.gpu_backend(), plan.explain()

    def tokens(kernels):
        cache = kvq.make_prompt_cache(model, method, window=32, sinks=4, kernels=kernels, **params)
        return [int(t) for (t, _), _ in zip(generate_step(prompt, model, prompt_cache=cache, max_tokens=24),
                                             range(24))]

    assert tokens("auto") == tokens("off")


@pytest.mark.parametrize("km,kp,vm,vp", [("qjl", {}, "affine", {"bits": 4}),
                                         ("turboquant_prod", {"bits": 4}, "turboquant_prod", {"bits": 4}),
                                         ("turboquant_prod", {"bits": 3}, "turboquant_prod", {"bits": 3})])
@pytest.mark.parametrize("sinks", [True, False])
def test_streams_bound_step_matches_parts(km, kp, vm, vp, sinks, streams_kernel_kind):
    """The bound decode step of the streams kernel (compressed tokens, sinks and window in one launch, the
    method's finish in the merge) equals the three parts attended in pure MLX and merged, within 2e-3 relative in
    bfloat16, for 2 batch rows; its output has the queries' dtype."""
    from kvq.attention import dense_attend, merge_parts

    reg = registry()
    kernel = reg.implementations[(km, kvq_metal.gpu_backend())]
    kparams, vparams = kvq.make_params(km, **kp), kvq.make_params(vm, **vp)
    if vm == "affine":
        vparams = vparams.for_head_dim(128)
    dt = mx.bfloat16
    k, v = _normal((2, 8, 3000, 128), dt, 41), _normal((2, 8, 3000, 128), dt, 42)
    ke = reg.implementations[(km, "mlx")].kvq_quantize(k, kparams)
    ve = reg.implementations[(vm, "mlx")].kvq_quantize(v, vparams)
    sk, sv = (_normal((2, 8, 4, 128), dt, 43), _normal((2, 8, 4, 128), dt, 44)) if sinks else (None, None)
    wk, wv = _normal((2, 8, 150, 128), dt, 45), _normal((2, 8, 150, 128), dt, 46)
    step = kernel.bind_dense(_normal((2, 32, 1, 128), dt, 47), ke, ve, 128 ** -0.5, sk, sv, wk, wv)
    assert step is not None, kvq_metal.base.CHECKS
    assert step.tensor_cores == (streams_kernel_kind and kvq_metal.gpu_backend() == "cuda")
    for n in (130, 131):
        q = _normal((2, 32, 1, 128), dt, n)
        out = step(q, wk[:, :, :n], wv[:, :, :n])
        parts = [reg.implementations[(km, "mlx")].kvq_attend(q, ke, ve, 128 ** -0.5, None),
                 dense_attend(q, wk[:, :, :n], wv[:, :, :n], 128 ** -0.5)]
        if sinks:
            parts.append(dense_attend(q, sk, sv, 128 ** -0.5))
        want, _ = merge_parts(parts)
        assert out.dtype == dt and out.shape == want.shape
        assert _rel(out, want) < 2e-3, n
