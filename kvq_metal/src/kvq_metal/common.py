"""What kernel implementations share (kvq_metal's and the methods' plugins'): query rows per KV head, the decode
shape test, and the first-use checks of decode attention against pure MLX."""

from __future__ import annotations

import mlx.core as mx

from kvq.attention import split_heads
from kvq.selection import MAX_DECODE_QUERIES

from .attend import MAX_ROWS


def rows_of(problem) -> int:
    """Query rows per KV head that ``problem`` asks for: ``n_rep * T_q``."""
    B, H, T, D = problem.shape
    return ((problem.num_q_heads or H) // H) * problem.num_queries


def query_rows(queries: mx.array, keys) -> int:
    """Query rows per KV head of a call: ``n_rep * T_q`` for ``queries [B, H_q, T_q, D]`` over ``keys`` (an
    Encoded of ``H_kv`` heads), as :func:`rows_of` for a problem."""
    return queries.shape[1] // keys.shape[1] * queries.shape[2]


def decode_shape_ok(problem) -> bool:
    """Decode problems the fused kernels serve: ``T_q <= MAX_DECODE_QUERIES`` and ``n_rep * T_q <= MAX_ROWS``."""
    return problem.num_queries <= MAX_DECODE_QUERIES and 1 <= rows_of(problem) <= MAX_ROWS


def grouped_rows(queries: mx.array, num_kv_heads: int, scale: float) -> mx.array:
    """``[B, H_q, T_q, D]`` -> scaled float32 ``[B, H_kv, n_rep, T_q, D]`` (as :func:`kvq.attention.blockwise_attend`
    prepares queries)."""
    return split_heads(queries.astype(mx.float32) * scale, num_kv_heads)


def normal(shape: tuple, seed: int, dtype=mx.float32, scale: float = 1.0) -> mx.array:
    """Standard normal test data drawn on the device from a fixed key (no host-to-device copy: on MLX's CUDA back
    end, arrays made from host buffers failed with ``cudaMemcpy ... invalid argument`` in mlx-lm's server thread,
    where first-use checks run)."""
    return (mx.random.normal(shape, key=mx.random.key(seed)) * scale).astype(dtype)


def check_attend(impl, quantize, params_k, params_v, head_dim: int, rows: int, dtype,
                 heads: int = 1) -> tuple[bool, str]:
    """Compare ``impl.kvq_attend`` with its pure-MLX fallback on a small problem (300 keys: two tiles and a
    partial one, GQA with ``rows`` query rows, ``heads`` KV heads: 1, or the count a calibration was recorded
    with): relative error must be below 1e-3."""
    T, Tq = 300, 1
    x = normal((2, heads, T, head_dim), 0, dtype)
    keys, values = quantize(x[:1], params_k), quantize(x[1:], params_v)
    q = normal((1, rows * heads, Tq, head_dim), 1, dtype)
    scale = head_dim ** -0.5
    got, lse = impl.attend_kernel(q, keys, values, scale)
    want, want_lse = impl.fallback().kvq_attend(q, keys, values, scale, None)
    err = relative_error(got, want)
    lse_err = mx.max(mx.abs(lse - want_lse)).item()
    return err < 1e-3 and lse_err < 1e-3, f"relative error {err:.2e}, lse error {lse_err:.2e} vs pure MLX"


def check_attend_dense(impl, params_k, params_v, head_dim: int, rows: int, dtype,
                       heads: int = 1) -> tuple[bool, str]:
    """Compare ``impl._attend_dense`` (compressed tokens plus 4 sinks and a 40-token window in one call) with the
    pure-MLX attention of the three parts merged by log-sum-exp, on 300 compressed tokens of ``heads`` KV heads
    (each side quantized by its own method's pure-MLX implementation): relative
    error below 1e-3 (a call the kernel does not take passes: the caller falls back to the parts anyway). Where the
    implementation binds decode steps (``bind_dense``: a :class:`kvq_metal.step.DecodeStep` from
    :func:`kvq_metal.attend.bind_decode` or :func:`kvq_metal.streams.bind_streams`), two bound steps
    (the second counts with the counters the first zeroed, over a window one token longer) must equal the unbound
    call's output in the queries' dtype."""
    from kvq.attention import DenseTokens, dense_attend, merge_parts

    pure = impl.fallback()
    keys, values, sk, sv, wk, wv, q, scale = _check_inputs(params_k, params_v, head_dim, rows, dtype, heads)
    got = impl._attend_dense(q, keys, values, scale, DenseTokens(sk, sv, wk[:, :, :40], wv[:, :, :40]))
    if got is None:
        return True, "not served for this shape"
    want, want_lse = merge_parts([pure.kvq_attend(q, keys, values, scale, None), dense_attend(q, sk, sv, scale),
                                  dense_attend(q, wk[:, :, :40], wv[:, :, :40], scale)])
    err = relative_error(got[0], want)
    lse_err = mx.max(mx.abs(got[1] - want_lse)).item()
    detail = f"relative error {err:.2e}, lse error {lse_err:.2e} vs the parts in pure MLX"
    ok = err < 1e-3 and lse_err < 1e-3
    step = impl._bind_unchecked(q, keys, values, scale, sk, sv, wk, wv)
    if step is not None:
        bound_err = 0.0
        for n in (40, 41):
            unbound = impl._attend_dense(q, keys, values, scale, DenseTokens(sk, sv, wk[:, :, :n], wv[:, :, :n]))
            out = step(q, wk[:, :, :n], wv[:, :, :n])
            bound_err = max(bound_err, relative_error(out, unbound[0].astype(q.dtype)))
        ok = ok and out.dtype == q.dtype and bound_err < 1e-6
        detail += f"; bound decode steps {bound_err:.2e} vs the unbound call ({out.dtype})"
    return ok, detail


def check_attend_ragged(impl, params_k, params_v, head_dim: int, rows: int, dtype,
                        heads: int = 1) -> tuple[bool, str]:
    """The first-use check of a ragged decode step (``bind_ragged_dense``: a ragged :class:`kvq_metal.step.
    DecodeStep`): two rows of one launch, one of 300 compressed and 41 window tokens, one of 173 and 9 (the
    inputs of :func:`check_attend_dense`, twice), each within 1e-2 relative (the queries' dtype) of the unbound call
    over that row alone. A shape the ragged step does not take passes (the caller attends the parts)."""
    from kvq.attention import DenseTokens

    keys, values, sk, sv, wk, wv, q, scale = _check_inputs(params_k, params_v, head_dim, rows, dtype, heads)
    step = impl._bind_unchecked(*_two_rows(q, keys, values, sk, sv, wk, wv, scale), ragged=True)
    if step is None:
        return True, "not served for this shape"
    q2, wk2, wv2 = (mx.concatenate([x, x], axis=0) for x in (q, wk, wv))
    out = step(q2, wk2, wv2, mx.array([[300, 41], [173, 9]], dtype=mx.int32))
    want0 = impl._attend_dense(q, keys, values, scale, DenseTokens(sk, sv, wk, wv))[0]
    want1 = impl._attend_dense(q, keys.tokens(0, 173), values.tokens(0, 173), scale,
                               DenseTokens(sk, sv, wk[:, :, :9], wv[:, :, :9]))[0]
    err = max(relative_error(out[:1], want0.astype(q.dtype)), relative_error(out[1:], want1.astype(q.dtype)))
    return err < 1e-2, f"ragged rows {err:.2e} vs each row alone"


def _check_inputs(params_k, params_v, head_dim: int, rows: int, dtype, heads: int) -> tuple:
    """The first-use checks' problem: 300 compressed tokens (each side quantized by its method's pure MLX), 4
    sinks and a 41-token window of ``heads`` KV heads, one query token of ``rows`` rows per head, the scale."""
    keys = quantize_with_method(normal((1, heads, 300, head_dim), 2, dtype), params_k)
    values = quantize_with_method(normal((1, heads, 300, head_dim), 3, dtype), params_v)
    sk, sv, wk, wv = (normal((1, heads, n, head_dim), seed, dtype) for n, seed in ((4, 4), (4, 5), (41, 6), (41, 7)))
    return keys, values, sk, sv, wk, wv, normal((1, rows * heads, 1, head_dim), 8, dtype), head_dim ** -0.5


def _two_rows(q, keys, values, sk, sv, wk, wv, scale):
    """The arguments of a ragged binding over two copies of a check's row (:func:`check_attend_dense`)."""
    two = (lambda x: mx.concatenate([x, x], axis=0))
    return (two(q), keys.map(two), values.map(two), scale, two(sk), two(sv), two(wk), two(wv))


def quantize_with_method(x: mx.array, params):
    """``x`` quantized by the pure-MLX implementation of ``params``' method (the first-use checks of a kernel whose
    keys and values may be of two methods: ``qjl`` keys with ``affine`` values).

    :raises KeyError: no ``mlx`` implementation of that method is installed."""
    from kvq.plugins import registry

    return registry().implementations[(params.method, "mlx")].kvq_quantize(x, params)


def code_mismatch(a: mx.array, b: mx.array, bits: int, count: int) -> float:
    """The fraction of ``bits``-bit codes that differ between two packed arrays uint32 ``[..., W]`` of ``count``
    codes each (:func:`kvq.packing.unpack`): how a first-use check compares a fused encoder's codes with pure MLX's."""
    from kvq import packing

    return mx.mean(packing.unpack(a, bits, count) != packing.unpack(b, bits, count)).item()


def relative_error(a, b) -> float:
    """``‖a - b‖ / ‖b‖`` in float32."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.sqrt(mx.sum((a - b) ** 2)) / mx.maximum(mx.sqrt(mx.sum(b * b)), 1e-30)).item()
