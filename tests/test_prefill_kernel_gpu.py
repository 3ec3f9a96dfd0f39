"""The fused prefill attention kernel (:func:`kvq_metal.prefill.prefill_attend`, CUDA only) against its float32
reference (:func:`kvq_metal.prefill.reference_attend`), on a GPU (``pytest -m gpu``; skipped elsewhere).

Tolerances (relative L2 of the output, absolute on the log-sum-exp): the kernel rounds the probabilities to the
inputs' dtype for the values' product and the output once, as FlashAttention does; the reference is float32 from
the same 16-bit inputs. Each rounding is at most half an ulp, so the expected relative L2 error is about 3e-4 in
float16 (11 significant bits) and 2e-3 in bfloat16 (8 bits): a numpy emulation of the kernel's fragments and
roundings gave 2.6e-4 and 2.0e-3-2.1e-3. Bounds: 1e-3 and 6e-3 (about three times that); the log-sum-exp comes
from float32 scores: 2e-3.

The kernel-level tests run each form (``form``: :class:`kvq_metal.knobs.PrefillKnobs` ``warpgroups`` 0, the
``mma.sync`` products, and 1 and 2, ``wgmma`` on compute capability 9.x, skipped elsewhere).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

kvq_metal = pytest.importorskip("kvq_metal")
from kvq_metal import prefill  # noqa: E402

TOLERANCE = {mx.float16: 1e-3, mx.bfloat16: 6e-3}
LSE_TOLERANCE = 2e-3


@pytest.fixture(autouse=True)
def _cuda():
    if kvq_metal.gpu_backend() != "cuda":
        pytest.skip("the prefill kernel exists on CUDA only")


@pytest.fixture(params=[(0, False), (1, False), (2, False), (1, True), (2, True)],
                ids=lambda f: f"wg{f[0]}" + ("p" if f[1] else ""))
def form(request, monkeypatch):
    """The kernel's form for the test: ``warpgroups`` n (0: mma.sync; 1, 2: wgmma, compute capability 9.x only)
    and ``pipeline`` (the wgmma form's pipelined schedule); returns ``warpgroups``."""
    import attrs

    warpgroups, pipeline = request.param
    if warpgroups and not prefill.has_wgmma():
        pytest.skip("wgmma runs on compute capability 9.x only")
    monkeypatch.setattr(prefill, "TUNING", attrs.evolve(prefill.TUNING, warpgroups=warpgroups, pipeline=pipeline))
    return warpgroups


def _served(form: int, head_dim: int) -> None:
    """Skip a wgmma form at a head_dim it does not serve (the launch falls back to mma.sync: a repeat)."""
    if form and not prefill.wgmma_serves(head_dim):
        pytest.skip(f"head_dim {head_dim} keeps mma.sync")


def _rel(a, b) -> float:
    a, b = np.asarray(a.astype(mx.float32)), np.asarray(b.astype(mx.float32))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _normal(shape, dtype, rng, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def kvq_intervals(Tq: int, sinks: int, compressed: int, window: int, step: int = 128) -> tuple[np.ndarray, int]:
    """``([Tq, 3, 2] int32 intervals, N)`` of a kvq chunk over ``[sinks | compressed | dense]`` columns: every row
    sees the sinks; row ``r`` sees the compressed prefix up to a bound that steps by ``step`` every ``step`` rows
    (tokens leaving the window during the chunk), and the dense band from its first uncompressed token to its own
    (``window`` tokens before the chunk, then the chunk: causal)."""
    r = np.arange(Tq)
    steps = (Tq - 1) // step
    first = max(compressed - step * steps, 0)
    bound = np.minimum(compressed, first + step * (r // step))
    dense0 = sinks + compressed
    iv = np.zeros((Tq, 3, 2), np.int32)
    iv[:, 0] = (0, sinks)
    iv[:, 1, 0], iv[:, 1, 1] = sinks, sinks + bound
    iv[:, 2, 0], iv[:, 2, 1] = dense0 + bound - first, dense0 + window + r + 1
    return iv, dense0 + window + Tq


def random_intervals(Tq: int, N: int, P: int, rng) -> np.ndarray:
    """``[Tq, P, 2]`` random intervals reaching past both ends of the columns, some empty, row 1 seeing nothing."""
    iv = np.sort(rng.integers(-16, N + 16, (Tq, P, 2)), axis=-1).astype(np.int32)
    iv[rng.random((Tq, P)) < 0.2] = [7, 3]  # empty
    if Tq > 1:
        iv[1] = [N + 1, N + 5]  # past the end: sees nothing
    return iv


def _check(q, k, v, iv, sinks, dtype):
    """The kernel against the reference: output, log-sum-exp, rows that see nothing."""
    scale = q.shape[-1] ** -0.5
    out, lse = prefill.prefill_attend(q, k, v, iv, scale, sinks, return_lse=True)
    ref, ref_lse = prefill.reference_attend(q, k, v, iv, scale, sinks)
    assert out.dtype == dtype and out.shape == ref.shape and lse.dtype == mx.float32 and lse.shape == ref_lse.shape
    assert _rel(out, ref) < TOLERANCE[dtype]
    got_lse, want_lse = np.array(lse), np.array(ref_lse)
    assert np.array_equal(np.isinf(got_lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    assert np.abs(got_lse[finite] - want_lse[finite]).max(initial=0.0) < LSE_TOLERANCE
    blind = ~np.array(prefill.visibility(mx.array(iv), k.shape[2]).any(axis=1))
    if blind.any():
        assert float(mx.abs(out[:, :, mx.array(np.flatnonzero(blind))]).max()) == 0.0


KVQ_CASES = [
    # head_dim, dtype, B, H_kv, n_rep, T_q, compressed, window, sink logits
    (128, mx.float16, 1, 2, 4, 512, 4096, 256, False),
    (128, mx.bfloat16, 1, 2, 4, 2048, 4096, 1024, True),
    (128, mx.float16, 1, 1, 8, 1, 8000, 100, True),
    (128, mx.bfloat16, 2, 2, 1, 16, 300, 32, False),
    (64, mx.float16, 1, 2, 8, 100, 1000, 64, True),
    (64, mx.bfloat16, 1, 1, 4, 2048, 6000, 128, False),
    (64, mx.float16, 2, 2, 1, 512, 0, 512, False),
    (256, mx.bfloat16, 1, 2, 2, 100, 2000, 128, False),
    (256, mx.float16, 1, 1, 4, 512, 1000, 512, True),
]


@pytest.mark.parametrize("case", KVQ_CASES, ids=lambda c: f"D{c[0]}-{str(c[1]).split('.')[-1]}-rep{c[4]}-T{c[5]}")
def test_kvq_chunk_matches_reference(case, form):
    """kvq's pattern (sinks, a compressed prefix whose bound steps every 128 rows, a causal band), GQA 1, 4, 8,
    chunks of 1 to 2048 rows over up to 8K columns, float16 and bfloat16, head_dim 64, 128 and 256."""
    D, dtype, B, Hkv, rep, Tq, compressed, window, sinks = case
    _served(form, D)
    rng = np.random.default_rng(Tq + D)
    iv, N = kvq_intervals(Tq, 4, compressed, window)
    q = _normal((B, Hkv * rep, Tq, D), dtype, rng)
    k, v = _normal((B, Hkv, N, D), dtype, rng), _normal((B, Hkv, N, D), dtype, rng)
    sink = _normal((Hkv * rep,), mx.float32, rng) if sinks else None
    _check(q, k, v, iv, sink, dtype)


RANDOM_CASES = [
    # head_dim, dtype, H_kv, n_rep, T_q, N, P, sink logits
    (64, mx.float16, 2, 1, 100, 700, 1, False),
    (128, mx.bfloat16, 1, 8, 16, 2000, 4, True),
    (128, mx.float16, 2, 4, 512, 1500, 2, True),
    (256, mx.float16, 1, 1, 16, 300, 4, False),
    (64, mx.bfloat16, 2, 4, 1, 90, 3, True),
]


@pytest.mark.parametrize("case", RANDOM_CASES, ids=lambda c: f"D{c[0]}-{str(c[1]).split('.')[-1]}-P{c[6]}-T{c[4]}")
def test_random_intervals_match_reference(case, form):
    """1 to 4 random intervals per row, overlapping, empty, reaching past the columns; a row that sees nothing
    gets zeros (and the sink logit as its log-sum-exp)."""
    D, dtype, Hkv, rep, Tq, N, P, sinks = case
    _served(form, D)
    rng = np.random.default_rng(N + P)
    iv = random_intervals(Tq, N, P, rng)
    q = _normal((1, Hkv * rep, Tq, D), dtype, rng, 2.0)  # larger scores: a sharper softmax
    k, v = _normal((1, Hkv, N, D), dtype, rng), _normal((1, Hkv, N, D), dtype, rng)
    sink = _normal((Hkv * rep,), mx.float32, rng) if sinks else None
    _check(q, k, v, iv, sink, dtype)


def test_no_row_sees_anything(form):
    """Every interval empty: zeros, lse -inf (the sink logit with sink logits)."""
    q, k, v = (mx.ones((1, 4, 70, 64), mx.float16), mx.ones((1, 2, 50, 64), mx.float16),
               mx.ones((1, 2, 50, 64), mx.float16))
    iv = mx.array(np.tile(np.array([[3, 3], [60, 90]], np.int32), (70, 1, 1)))
    out, lse = prefill.prefill_attend(q, k, v, iv, 0.1, return_lse=True)
    assert float(mx.abs(out).max()) == 0.0 and bool(mx.all(lse == -mx.inf))
    sink = mx.array([0.5, -1.0, 2.0, 0.0])
    out, lse = prefill.prefill_attend(q, k, v, iv, 0.1, sink, return_lse=True)
    assert float(mx.abs(out).max()) == 0.0
    assert np.allclose(np.array(lse), np.broadcast_to(np.array(sink)[None, :, None], (1, 4, 70)), atol=1e-5)


def test_views_are_read_as_their_values():
    """Keys and values that are views (a prefix of a longer buffer; tokens and heads swapped) and queries in another
    layout give what their contiguous copies give (MLX copies them to rows before the launch)."""
    rng = np.random.default_rng(5)
    iv, N = kvq_intervals(64, 4, 200, 40)
    k = _normal((1, 2, N + 100, 128), mx.float16, rng)[:, :, :N]
    v = _normal((1, N, 2, 128), mx.float16, rng).swapaxes(1, 2)
    q = _normal((1, 64, 8, 128), mx.float16, rng).swapaxes(1, 2)  # [1, 8, 64, 128], strided
    got = prefill.prefill_attend(q, k, v, iv, 0.1)
    want = prefill.prefill_attend(mx.array(np.array(q)), mx.array(np.array(k)), mx.array(np.array(v)), iv, 0.1)
    assert _rel(got, want) == 0.0


def test_agrees_with_mlx_attention_with_a_mask(form):
    """On kvq's pattern the kernel and the path it replaces (``mx.fast.scaled_dot_product_attention`` with an
    additive mask in the queries' dtype, :func:`kvq.cache.prefill.attend_dequantized`) agree within both their
    roundings (each within 1e-3 of float32)."""
    rng = np.random.default_rng(6)
    iv, N = kvq_intervals(300, 4, 1000, 200)
    q = _normal((1, 8, 300, 128), mx.float16, rng)
    k, v = _normal((1, 2, N, 128), mx.float16, rng), _normal((1, 2, N, 128), mx.float16, rng)
    seen = prefill.visibility(mx.array(iv), N)
    mask = mx.where(seen, mx.array(0, mx.float16), mx.array(mx.finfo(mx.float16).min, mx.float16))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask=mask)
    assert _rel(prefill.prefill_attend(q, k, v, iv, 0.1), want) < 2e-3


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_wgmma_form_runs_and_matches_mma_sync(D, dtype, monkeypatch):
    """On compute capability 9.x the ``wgmma`` form is what runs for head_dim 64 and 128 (its template's ``WG``
    set, one or two warpgroups a block) and gives the ``mma.sync`` form's output within float32 accumulation
    order (both round the same probabilities to 16 bits): relative L2 within a tenth of the reference
    tolerance (head_dim 256 keeping ``mma.sync`` is the CPU test's: its launch plan)."""
    import attrs

    if not prefill.has_wgmma():
        pytest.skip("wgmma runs on compute capability 9.x only")
    rng = np.random.default_rng(D)
    iv, N = kvq_intervals(700, 4, 3000, 300)
    q = _normal((1, 8, 700, D), dtype, rng)
    k, v = _normal((1, 2, N, D), dtype, rng), _normal((1, 2, N, D), dtype, rng)
    outs = {}
    forms = [(0, False), (1, False), (2, False), (1, True), (2, True)]
    for n, pipe in forms:
        monkeypatch.setattr(prefill, "TUNING", attrs.evolve(prefill.TUNING, warpgroups=n, pipeline=pipe))
        plan = prefill.launch_plan(q.shape, k.shape, dtype, 3, 0.1, False, 0, n, pipe)
        assert dict(plan.template)["WG"] is (n > 0) and plan.threadgroup[0] == 128 * max(n, 1)
        assert dict(plan.template)["PIPE"] is pipe and (plan.dynamic_bytes > 0) is pipe
        outs[n, pipe] = prefill.prefill_attend(q, k, v, iv, 0.1)
    baked = prefill.PREFILL_ATTEND_TC.kernel("cuda", prefill.INPUTS, prefill.OUTPUTS)._baked  # what launched
    assert all(any({("D", D), ("WG", True), ("PIPE", pipe), ("THREADS", 128 * n)} <= set(full) for full, *_ in baked)
               for n, pipe in forms[1:])
    assert all(_rel(outs[f], outs[0, False]) < TOLERANCE[dtype] / 10 for f in forms[1:])


@pytest.mark.parametrize("label", ["turboquant:4", "turboquant:3", "affine:4"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_a_cache_prefill_through_the_kernel_matches_the_masked_path(label, dtype, monkeypatch):
    """Wired (issue #51): with :data:`kvq_metal.prefill.TUNING` ``tc`` on, a kvq cache's chunked prefill on the GPU
    runs the kernel (its first-use check passes and every chunk after the first compression calls it) and the
    logits of every position stay within KL 1e-3 of the masked path's (knob off; both 16-bit attention over the
    same decoded columns), for chunks of 16 and 100."""
    import attrs
    from conftest import tiny_llama
    from kvq.evaluation.spec import make_cache, parse_method
    from kvq_metal.base import CHECKS

    model = tiny_llama(dtype=dtype)
    prompt = mx.array([(7 * i + 3) % 256 for i in range(240)])[None]
    calls = []
    real = prefill.launch
    monkeypatch.setattr(prefill, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))

    def logits(tc: bool, chunk: int) -> np.ndarray:
        monkeypatch.setattr(prefill, "TUNING", attrs.evolve(prefill.TUNING, tc=tc))
        cache = make_cache(model, parse_method(label), sinks=4, window=32)
        outs = [model(prompt[:, s : s + chunk], cache=cache)[0].astype(mx.float32) for s in range(0, 240, chunk)]
        return np.asarray(mx.concatenate(outs, axis=0))

    def kl(p, q):
        lp = p - np.log(np.exp(p - p.max(-1, keepdims=True)).sum(-1, keepdims=True)) - p.max(-1, keepdims=True)
        lq = q - np.log(np.exp(q - q.max(-1, keepdims=True)).sum(-1, keepdims=True)) - q.max(-1, keepdims=True)
        return float(np.mean(np.sum(np.exp(lp) * (lp - lq), -1)))

    for chunk in (16, 100):
        before = len(calls)
        masked, fused = logits(False, chunk), logits(True, chunk)
        assert len(calls) > before, chunk
        assert kl(masked, fused) < 1e-3, chunk
    assert [passed for (_, name, _), (passed, _) in CHECKS.items() if name == "prefill_attend"] and all(
        passed for (_, name, _), (passed, _) in CHECKS.items() if name == "prefill_attend")
