"""``turboquant`` on kvq_metal's kernels: fused encode (normalise + randomized Hadamard + Lloyd-Max + pack), fused
decode, and decode attention in the rotated domain.

TurboQuant-mse (Zandieh et al., arXiv 2504.19874). Attention rotates the queries once and inverse-rotates the
output once (the pure-MLX implementation's ``prepare_queries``/``finish_values``); in between, the kernel scores
``norm_t * Σ_j q_j c[code_tj]`` and accumulates ``p_t * norm_t * c[code_tj]`` straight from the packed codes.
Served: ``turboquant`` without outlier channels, bits 1-4, head_dim rotated at a power of two in 32..256
(``params.rotated_dim``; quantize/dequantize also need the Hadamard rotation; attention takes either rotation).
Everything else is served by pure MLX, with the same result: the other Hadamard sizes (80 = 20 · 4, 96 = 12 · 8,
112 = 28 · 4 ...), because the kernels' Hadamard transforms are power-of-two butterflies.
"""

from __future__ import annotations

import mlx.core as mx

from kvq.encoded import Encoded
from kvq_metal import attend, gpu_backend
from kvq_metal.base import KernelImpl, first_use_check
from kvq_metal.common import (check_attend, code_mismatch, decode_shape_ok, grouped_rows, normal, query_rows,
                              relative_error, rows_of)

from .. import codebook, mse, rotation
from ..impl import head_dim_supported, padding_note
from ..params import TurboQuantParams
from . import quantize as fused


def _plain(params) -> bool:
    """TurboQuant-mse without outlier channels (``turboquant_prod`` and mixed precision are not served)."""
    return type(params) is TurboQuantParams and params.outlier_channels == 0


def _codec_serves(params, head_dim: int) -> bool:
    """Whether the fused encode and decode serve ``params`` at ``head_dim``: plain TurboQuant-mse with the
    Hadamard rotation at a size :func:`kvq_backends_turboquant.kernels.quantize.supported` takes."""
    return (_plain(params) and params.rotation == "hadamard"
            and fused.supported(head_dim, params.rotated_dim(head_dim), params.bits))


def power_of_two(dim: int) -> bool:
    """Whether ``dim`` is a power of two: the only rotation sizes the kernels' Hadamard butterflies (and the decode
    kernel's in-kernel query rotation) serve."""
    return dim & (dim - 1) == 0


def _side(encoded) -> attend.Side:
    p = encoded.params
    dim = p.rotated_dim(encoded.head_dim)
    return attend.Side(encoded.data["codes"], encoded.data["norms"], None, codebook.codebook(dim, p.bits).centroids,
                       p.bits, dim)


def rotated_kernel_serves(queries, keys, values, mask, accepts) -> bool:
    """Whether the rotated-domain decode kernel serves this ``kvq_attend`` call: no mask, at least one key, both
    sides' parameters accepted by ``accepts(params)``, one head_dim and one rotation size (a power of two), whole
    GQA groups, a shape :func:`kvq_metal.attend.supported` takes. Otherwise pure MLX serves it (same result)."""
    B, Hq, _, D = queries.shape
    if not (accepts(keys.params) and accepts(values.params)):
        return False
    dim, Hkv = keys.params.rotated_dim(D), keys.shape[1]
    return (mask is None and keys.num_tokens > 0 and keys.head_dim == D and values.head_dim == D
            and values.params.rotated_dim(D) == dim and power_of_two(dim) and Hq % Hkv == 0
            and attend.supported(dim, keys.params.bits, values.params.bits, dim, dim, query_rows(queries, keys)))


def rotated_attend(impl, queries, keys, values, scale, side):
    """Decode attention over codes in the rotated domain (``turboquant``, ``turboquant_rvq``).

    With the randomized Hadamard rotation and the same seed on both sides, the kernels rotate the queries and
    inverse-rotate the output themselves; otherwise the pure-MLX implementation's ``prepare_queries`` and
    ``finish_values`` do it (one dense rotation each). :param side: Encoded -> :class:`~kvq_metal.attend.Side`.
    """
    call = _rotated_call(keys, values, side)
    if call is not None:
        return attend.decode_attend(queries, scale, call.keys, call.values, impl.backend, signs=call.signs,
                                    out_dim=call.out_dim)
    mlx_impl = impl.fallback()
    q = mlx_impl.prepare_queries(grouped_rows(queries, keys.shape[1], scale), keys)
    B, H, n_rep, Tq, dim = q.shape
    out, lse = attend.decode_attend(q.reshape(B, H * n_rep, Tq, dim), 1.0, side(keys), side(values), impl.backend)
    out = mlx_impl.finish_values(out.reshape(B, H, n_rep, Tq, dim), values)
    return out.reshape(queries.shape[:3] + (out.shape[-1],)), lse


def _rotated_call(keys, values, side):
    """The kernel call that rotates queries and output in the kernel (:class:`kvq_metal.attend.DenseCall`): both
    sides with the randomized Hadamard rotation of one seed; ``None`` otherwise."""
    kp, vp = keys.params, values.params
    if not (kp.rotation == vp.rotation == "hadamard" and kp.seed == vp.seed):
        return None
    dim = kp.rotated_dim(keys.head_dim)
    signs = rotation.rotation("hadamard", dim, kp.seed).signs
    return attend.DenseCall(side(keys), side(values), signs, values.head_dim)


def rotated_dense_call(impl, queries, keys, values, side):
    """:meth:`KernelImpl._dense_call` for the rotated-domain methods: the in-kernel rotation and the tensor-core
    kernel (which reads the uncompressed tokens), else ``None``."""
    call = _rotated_call(keys, values, side)
    if call is None or not attend.serves_dense(impl.backend, call.signs.shape[0], call.keys, call.values,
                                               query_rows(queries, keys)):
        return None
    return call


class TurboQuantKernels(KernelImpl):
    """Kernel implementation of ``turboquant`` (quantize, dequantize, attend); see the module docstring."""

    method = "turboquant"

    def kernel_supports(self, problem) -> bool:
        """Plain TurboQuant-mse (no outlier channels) rotated at a power of two: decode attention within
        :func:`kvq_metal.attend.supported`; quantize/dequantize with the Hadamard rotation at 32..256. Each after
        its first-use check."""
        p = problem.params or TurboQuantParams()
        D = problem.head_dim
        if not (_plain(p) and head_dim_supported(p, D)):
            return False
        dim = p.rotated_dim(D)
        if not power_of_two(dim):  # 80, 96, 112 ...: pure MLX
            return False
        if problem.op == "attend":
            rows = rows_of(problem)
            if not (decode_shape_ok(problem) and attend.supported(dim, p.bits, p.bits, dim, dim, rows)):
                return False
            return first_use_check(self.backend, "decode_attend[turboquant]", (dim, p.bits, p.norm_dtype, rows),
                                   lambda: check_attend(self, self.fallback().kvq_quantize, p, p, D, rows,
                                                        problem.dtype))
        if problem.op in ("quantize", "dequantize"):
            if not _codec_serves(p, D):
                return False
            return self._codec_checked(p, D, problem.dtype)
        return False

    def explain(self, problem) -> str:
        """:meth:`KernelImpl.explain`; where the kernel serves ``problem`` and the rotation pads head_dim, what that
        costs (:func:`~kvq_backends_turboquant.impl.padding_note`)."""
        return super().explain(problem) or padding_note(problem.params or TurboQuantParams(), problem.head_dim)

    def cost(self, problem) -> float:
        """Quantize/dequantize: one kernel reading and writing each vector once; attend: one kernel over the
        packed codes and norms of K and V plus the query rotation, output rotation and split merge."""
        p = problem.params or TurboQuantParams()
        B, H, T, D = problem.shape
        dim = p.rotated_dim(D)
        packed = B * H * T * (dim * p.bits / 8 + p.norm_bits / 8)
        if problem.op == "attend":
            return self.estimate(problem, launches=10, bytes_moved=2 * packed)
        return self.estimate(problem, launches=1, bytes_moved=packed + B * H * T * D * problem.dtype.size)

    # -- ops ----------------------------------------------------------------------------------------
    def kvq_quantize(self, x, params):
        """``kvq_quantize`` spec: the same Encoded as the pure-MLX implementation (codes, norms)."""
        D = x.shape[-1]
        if not (head_dim_supported(params, D) and _codec_serves(params, D)
                and x.size and x.dtype in (mx.float16, mx.bfloat16, mx.float32) and x.ndim == 4):
            return self.fallback().kvq_quantize(x, params)
        dim = params.rotated_dim(D)
        rot = rotation.rotation("hadamard", dim, params.seed)
        norm_dtype = mx.float16 if params.norm_dtype == "float16" else mx.float32
        codes, norms = fused.quantize(x, rot.signs, codebook.codebook(dim, params.bits).boundaries, params.bits,
                                      norm_dtype, self.backend)
        return Encoded(params, {"codes": codes, "norms": norms}, D)

    def kvq_dequantize(self, encoded, dtype):
        """``kvq_dequantize`` spec: ``[B, H, T, D]`` of ``dtype``."""
        out = self._decode(encoded, dtype, 0, 0)
        return self.fallback().kvq_dequantize(encoded, dtype) if out is None else out

    def dequantize_into(self, encoded, dtype, before, after):
        """:class:`kvq.contract.DequantizesInto`: the fused decode writing each row's tokens between ``before``
        and ``after`` unwritten columns (:func:`kvq_backends_turboquant.kernels.quantize.dequantize_into`), on
        this object's own device and after the codec's first-use check (the one :meth:`kernel_supports` runs);
        ``None`` elsewhere and for what the kernel does not serve (other variants, rotations, widths; no tokens)."""
        p, D = encoded.params, encoded.head_dim
        if gpu_backend() != self.backend or not _codec_serves(p, D):
            return None
        if not self._codec_checked(p, D, dtype):
            return None
        return self._decode(encoded, dtype, before, after)

    def _decode(self, encoded, dtype, before, after):
        p, D = encoded.params, encoded.head_dim
        if not (_codec_serves(p, D) and encoded.num_tokens):
            return None
        dim = p.rotated_dim(D)
        mse.check_stored_width(encoded.data, "codes", p, D)
        rot = rotation.rotation("hadamard", dim, p.seed)
        return fused.dequantize_into(encoded.data["codes"], encoded.data["norms"], rot.signs,
                                     codebook.codebook(dim, p.bits).centroids, p.bits, D, dtype, self.backend,
                                     before, after)

    def attend_kernel(self, queries, keys, values, scale):
        """The kernel path of :meth:`kvq_attend` (no checks)."""
        return rotated_attend(self, queries, keys, values, scale, _side)

    def kvq_attend(self, queries, keys, values, scale, mask):
        """``kvq_attend`` spec; pure MLX serves masks, other variants and shapes beyond the kernel."""
        if not rotated_kernel_serves(queries, keys, values, mask, _plain):
            return self.fallback().kvq_attend(queries, keys, values, scale, mask)
        return self.attend_kernel(queries, keys, values, scale)

    def _dense_call(self, queries, keys, values):
        """:meth:`KernelImpl._dense_call` (the randomized Hadamard rotation and the tensor-core kernel)."""
        if not rotated_kernel_serves(queries, keys, values, None, _plain):
            return None
        return rotated_dense_call(self, queries, keys, values, _side)

    # -- first-use check ----------------------------------------------------------------------------
    def _codec_checked(self, params, head_dim: int, dtype) -> bool:
        """Whether the fused encode and decode passed their first-use check (:meth:`_check_codec`, run once per
        width, bits, norm dtype and output dtype) on this device: what :meth:`kernel_supports` asks for quantize
        and dequantize, and :meth:`dequantize_into` before it decodes."""
        return first_use_check(self.backend, "tq_codec", (head_dim, params.bits, params.norm_dtype, str(dtype)),
                               lambda: self._check_codec(params, head_dim, dtype))

    def _check_codec(self, params, head_dim: int, dtype) -> tuple[bool, str]:
        """Encode 512 random vectors with both implementations: at most 0.1% of codes may differ (a rotated
        coordinate within float rounding of a cell boundary), norms within 1e-3 relative, and the kernel's
        decode equals the pure-MLX decode of the same codes within 1e-4 relative."""
        x = normal((1, 2, 256, head_dim), 9, dtype, scale=3.0)
        got, want = self.kvq_quantize(x, params), self.fallback().kvq_quantize(x, params)
        dim = got.data["codes"].shape[-1] * 32 // params.bits
        differ = code_mismatch(got.data["codes"], want.data["codes"], params.bits, dim)
        norm_err = relative_error(got.data["norms"], want.data["norms"])
        dec_err = relative_error(self.kvq_dequantize(want, mx.float32),
                                 self.fallback().kvq_dequantize(want, mx.float32))
        ok = differ <= 1e-3 and norm_err < 1e-3 and dec_err < 1e-4
        return ok, f"{differ:.2e} of codes differ, norm error {norm_err:.2e}, decode error {dec_err:.2e}"
