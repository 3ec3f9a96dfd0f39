"""Mixed precision with outlier channels chosen from data (``turboquant`` with ``outlier_select="data"``).

TurboQuant (Zandieh et al., arXiv 2504.19874, section 4.3) reaches fractional bit widths by splitting the channels
of the *original* vectors into an outlier set and the rest, and applying two independent TurboQuant instances,
the outlier set with more bits (its "2.5-bit" setting: 32 of 128 channels at 3 bits and 96 at 2, which averages
2.25 bits of codes; 64 and 64 average 2.5). Here the ``k = outlier_channels`` channels with the largest second
moment (or mean ``|x|``) are chosen per KV head from the first block a layer's cache compresses
(:func:`choose_channels`, through ``TurboQuantParams.fit``) or given from calibration; they are shared state of the
layer, stored once (``params.outlier_indices``), never per token.

Each group is its own TurboQuant-mse instance: normalised by its own norm, rotated at its own size
(:func:`~kvq_backends_turboquant.rotation.group_dim`; the two rotations are independent streams of ``seed``) and
quantized with the Lloyd-Max codebook of that size. Stored per token, all ``[B, H_kv, T, ...]``:
``outlier_codes`` uint32 ``[..., ceil(k_dim · outlier_bits / 32)]``, ``codes`` uint32
``[..., ceil(r_dim · bits / 32)]``, ``outlier_norms`` and ``norms`` ``[B, H_kv, T]`` (``params.norm_dtype``),
with ``k_dim = group_dim(k)``, ``r_dim = group_dim(D - k)``.

Non-finite input (kvq's policy, :class:`kvq.contract.Quantizes`): a vector with a NaN or ±inf coordinate gets
NaN norms in both groups, so all of it decodes to NaN; when channels are chosen, non-finite coordinates count as 0.
"""

from __future__ import annotations

from functools import lru_cache

import attrs
import mlx.core as mx
import numpy as np

from kvq import packing

from .codebook import Codebook, codebook
from .mse import normalise, pack_codes, store_norms
from .rotation import Rotation, group_dim, rotation

SELECTS = ("rotated", "data")
STATISTICS = ("second_moment", "mean_abs")


def choose_channels(block: mx.array, k: int, statistic: str) -> tuple[tuple[int, ...], ...]:
    """The ``k`` channels of each KV head with the largest statistic over the block's batch and tokens.

    :param block: ``[B, H_kv, T, D]`` float keys or values, ``T >= 1``.
    :param statistic: ``"second_moment"`` (mean ``x²``) or ``"mean_abs"`` (mean ``|x|``), computed in float32;
        NaN and ±inf coordinates count as 0 (one bad token must not choose the layer's channels).
    :return: ``H_kv`` ascending tuples of ``k`` channel indices; ties go to the lower index (reproducible).
    :raises ValueError: an empty block, or ``k`` not in ``1..D - 1``.
    """
    B, H, T, D = block.shape
    if T == 0 or B == 0:
        raise ValueError("outlier channels are chosen from data: the block must hold at least one token")
    if not 1 <= k < D:
        raise ValueError(f"outlier_channels must be in 1..{D - 1} (head_dim {D}) to choose them from data; got {k}")
    x = block.astype(mx.float32)
    x = mx.where(mx.isfinite(x), x, 0.0)
    stat = mx.mean(x * x if statistic == "second_moment" else mx.abs(x), axis=(0, 2))
    order = np.argsort(-np.array(stat, dtype=np.float64), axis=-1, kind="stable")[:, :k]
    return tuple(tuple(int(c) for c in np.sort(row)) for row in order)


@attrs.frozen(eq=False)
class Group:
    """One TurboQuant instance of a channel group: ``channels`` coordinates rotated at ``dim``, ``bits`` per code."""

    field: str
    norms_field: str
    channels: int
    bits: int
    rotation: Rotation
    codebook: Codebook

    @property
    def dim(self) -> int:
        """The rotation size (``channels`` zero-padded to a Hadamard size)."""
        return self.rotation.dim

    def encode(self, x: mx.array, params, finite: mx.array) -> dict[str, mx.array]:
        """``x`` float32 ``[..., channels]`` -> ``{field: packed codes, norms_field: norms}``; the norm is NaN where
        ``finite`` (bool ``[...]``: the whole vector's coordinates all finite) is False."""
        unit, norms = normalise(x)
        norms = mx.where(finite, norms, float("nan"))
        codes = self.codebook.encode(self.rotation.forward(unit))
        return {self.field: pack_codes(codes, self.bits), self.norms_field: store_norms(norms, params)}

    def decode_rotated(self, data) -> mx.array:
        """Unit-vector estimates in this group's rotated domain: float32 ``[B, H, T, dim]``."""
        return self.codebook.decode_packed(data[self.field], self.dim)

    def norms(self, data) -> mx.array:
        """The stored norms as float32 ``[B, H, T]``."""
        return data[self.norms_field].astype(mx.float32)


@attrs.frozen(eq=False)
class Split:
    """The two groups of one fitted parameter object at one head_dim, and the channel permutation.

    :param permutation: int32 ``[H_kv, D]``: each head's outlier channels, then the rest (each ascending).
    :param inverse: int32 ``[H_kv, D]``: the inverse permutation.
    """

    permutation: mx.array
    inverse: mx.array
    outlier: Group
    regular: Group

    @property
    def groups(self) -> tuple[Group, Group]:
        return self.outlier, self.regular

    def gather(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """``x`` ``[B, H, ..., D]`` (head axis 1) -> its outlier and regular channels, float32."""
        perm = self.permutation.reshape((1, -1) + (1,) * (x.ndim - 3) + (x.shape[-1],))
        x = mx.take_along_axis(x.astype(mx.float32), perm, axis=-1)
        return x[..., : self.outlier.channels], x[..., self.outlier.channels :]

    def scatter(self, outlier: mx.array, regular: mx.array) -> mx.array:
        """Inverse of :meth:`gather`: the two groups back in channel order, ``[B, H, ..., D]``."""
        x = mx.concatenate([outlier, regular], axis=-1)
        inverse = self.inverse.reshape((1, -1) + (1,) * (x.ndim - 3) + (x.shape[-1],))
        return mx.take_along_axis(x, inverse, axis=-1)


@lru_cache(maxsize=256)
def split_of(params, head_dim: int) -> Split:
    """The :class:`Split` of fitted ``turboquant`` parameters with ``outlier_select="data"`` (cached).

    :raises ValueError: parameters without ``outlier_indices`` (not fitted yet).
    """
    if params.outlier_indices is None:
        raise ValueError("turboquant with outlier_select='data' needs outlier_indices: the cache sets them on the "
                         "first block it compresses (params.fit(block)); without a cache call params.fit(block) or "
                         "pass outlier_indices")
    params.check_head_dim(head_dim)
    k = params.outlier_channels
    chosen = np.array(params.outlier_indices, dtype=np.int64)
    rest = np.array([np.setdiff1d(np.arange(head_dim), row) for row in chosen], dtype=np.int64).reshape(len(chosen), -1)
    permutation = np.concatenate([chosen, rest], axis=1)
    groups = []
    for field, channels, bits, outlier in (("outlier_codes", k, params.outlier_bits, True),
                                           ("codes", head_dim - k, params.bits, False)):
        dim = group_dim(channels, params.rotation)
        groups.append(Group(field, "outlier_norms" if outlier else "norms", channels, bits,
                            rotation(params.rotation, dim, params.seed, outlier), codebook(dim, bits)))
    return Split(mx.array(permutation.astype(np.int32)), mx.array(np.argsort(permutation, axis=1).astype(np.int32)),
                 *groups)


def check_heads(split: Split, num_heads: int) -> None:
    """:raises ValueError: ``num_heads`` differs from the number of heads the channels were chosen for."""
    fitted = split.permutation.shape[0]
    if num_heads != fitted:
        raise ValueError(f"x has {num_heads} KV heads, but outlier_indices were chosen for {fitted}")


def quantize(x: mx.array, params) -> dict[str, mx.array]:
    """Encode ``x`` ``[B, H_kv, T, D]`` (any float dtype) as the four fields of the module docstring."""
    split = split_of(params, x.shape[-1])
    check_heads(split, x.shape[1])
    fields, finite = {}, mx.all(mx.isfinite(x), axis=-1)
    for group, part in zip(split.groups, split.gather(x)):
        fields.update(group.encode(part, params, finite))
    return fields


def dequantize(data, params, head_dim: int) -> mx.array:
    """``[B, H_kv, T, D]`` float32: each group's ``‖x_g‖ · Π_gᵀ c[idx]`` (padding dropped), back in channel order."""
    split = split_of(params, head_dim)
    parts = [g.rotation.inverse(g.decode_rotated(data) * g.norms(data)[..., None])[..., : g.channels]
             for g in split.groups]
    return split.scatter(*parts)


def accounting(params, head_dim: int) -> tuple[dict[str, int], int]:
    """``(per-token bits by field, shared bytes)``: whole uint32 words of both code fields and two norms; shared:
    both rotations and codebooks, and (once fitted) the int32 permutation and its inverse, ``2 · 4 · H_kv · D``."""
    k, norm_bits = params.outlier_channels, 16 if params.norm_dtype == "float16" else 32
    per_token, shared = {}, 0
    for field, channels, bits, outlier in (("outlier_codes", k, params.outlier_bits, True),
                                           ("codes", head_dim - k, params.bits, False)):
        dim = group_dim(channels, params.rotation)
        per_token[field] = 32 * packing.packed_words(dim, bits)
        shared += rotation(params.rotation, dim, params.seed, outlier).nbytes + codebook(dim, bits).nbytes
    per_token.update(norms=norm_bits, outlier_norms=norm_bits)
    if params.outlier_indices is not None:
        shared += 2 * 4 * len(params.outlier_indices) * head_dim
    return per_token, shared


# -- block protocol pieces (see kvq_backends_turboquant.impl) -----------------------------------------------
def rotate_queries(q: mx.array, params, head_dim: int) -> mx.array:
    """Scaled ``q`` ``[B, H_kv, n_rep, T_q, D]`` -> ``[Π_o q_outlier, Π_r q_regular]`` ``[..., k_dim + r_dim]``."""
    split = split_of(params, head_dim)
    return mx.concatenate([g.rotation.forward(part) for g, part in zip(split.groups, split.gather(q))], axis=-1)


def scores(q: mx.array, block, head_dim: int) -> mx.array:
    """``q · k̃`` float32 ``[B, H_kv, n_rep, T_q, T]``: each group's centroids times its norms, summed."""
    split, start, total = split_of(block.params, head_dim), 0, None
    for g in split.groups:
        y = g.decode_rotated(block.data)[:, :, None]
        s = (q[..., start : start + g.dim] @ y.swapaxes(-1, -2)) * g.norms(block.data)[:, :, None, None, :]
        total, start = s if total is None else total + s, start + g.dim
    return total


def weighted_values(p: mx.array, block, head_dim: int) -> mx.array:
    """``p @ ṽ`` per group in its rotated domain, concatenated: float32 ``[B, H_kv, n_rep, T_q, k_dim + r_dim]``."""
    split = split_of(block.params, head_dim)
    return mx.concatenate([(p * g.norms(block.data)[:, :, None, None, :]) @ g.decode_rotated(block.data)[:, :, None]
                           for g in split.groups], axis=-1)


def finish_values(out: mx.array, params, head_dim: int) -> mx.array:
    """Normalised ``[..., k_dim + r_dim]`` -> ``[B, H_kv, n_rep, T_q, D]``: inverse rotations, channel order."""
    split = split_of(params, head_dim)
    k_dim = split.outlier.dim
    parts = [g.rotation.inverse(y)[..., : g.channels]
             for g, y in zip(split.groups, (out[..., :k_dim], out[..., k_dim:]))]
    return split.scatter(*parts)
