"""``turboquant_rvq``: TurboQuant's rotation, then two-stage residual scalar quantization of every coordinate.

Each vector ``x`` (head_dim ``D``, zero-padded to ``D_pad``: :meth:`TurboQuantRVQParams.rotated_dim`) is normalised
and rotated as in ``turboquant``
(Zandieh et al., arXiv 2504.19874): ``y = Π x / ‖x‖``. Every coordinate is quantized with the stage-1 Lloyd-Max
codebook ``c1`` (``bits`` bits, :mod:`~kvq_backends_turboquant.codebook`), and its residual ``y - c1[idx1]`` with
the stage-2 codebook ``c2`` (``residual_bits`` bits), the Lloyd-Max quantizer of that residual's exact density
(:mod:`~kvq_backends_turboquant.residual_codebook`; residual VQ, Juang & Gray, ICASSP 1982). Then

    ``x̃ = ‖x‖ · Πᵀ (c1[idx1] + c2[idx2])``  (padding dropped).

Stored per token and KV head (the layout fused kernels read; all with the token axis at 2):

* ``codes``: uint32 ``[B, H, T, ceil(D_pad · bits / 32)]``, the stage-1 codes packed densely
  (:func:`kvq.packing.pack`: a 3-bit code costs 3 bits and may straddle two words);
* ``residual_codes``: uint32 ``[B, H, T, ceil(D_pad · residual_bits / 32)]``, the stage-2 codes, packed alike;
* ``norms``: ``[B, H, T]`` ``params.norm_dtype``, ``‖x‖`` (once per vector).

Shared per layer: the rotation and the two centroid tables (:meth:`TurboQuantRVQParams.codebooks`).
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import mlx.core as mx

import kvq
from kvq import packing
from kvq.packing import packed_words
from kvq.validate import attrs_one_of

from .codebook import codebook
from .mse import check_stored_width, pack_codes, rotation_of
from .params import BITS, MAX_HEAD_DIM, NORM_DTYPES, _non_negative_int, rotated_dim_of
from .residual_codebook import residual_codebook
from .rotation import ROTATIONS


@attrs.frozen(cache_hash=True)  # hashed on every decode step (selection and kernel-check keys)
class TurboQuantRVQParams:
    """Parameters of ``turboquant_rvq`` (see the module docstring).

    :param bits: stage-1 code width ``b1`` per rotated coordinate, 1..4 (default 2).
    :param residual_bits: stage-2 code width ``b2``, 1..4 (default 2). Codes cost ``b1 + b2`` bits per padded
        coordinate; e.g. ``bits=2, residual_bits=1`` at head_dim 128 stores 3 + 16/128 = 3.125 bits per coordinate.
    :param rotation: ``"hadamard"`` (randomized fast Walsh-Hadamard, default) or ``"qr"`` (dense, for checks).
    :param seed: int >= 0 seeding the rotation (the same rotation as ``turboquant`` with the same seed).
    :param norm_dtype: ``"float16"`` (default) or ``"float32"``: storage of the per-vector norm.
    :raises ValueError: any value outside those ranges (the message names the parameter and what is allowed).
    """

    method: ClassVar[str] = "turboquant_rvq"

    bits: int = attrs.field(default=2, validator=attrs_one_of(BITS))
    residual_bits: int = attrs.field(default=2, validator=attrs_one_of(BITS))
    rotation: str = attrs.field(default="hadamard", validator=attrs_one_of(ROTATIONS))
    seed: int = attrs.field(default=0, validator=_non_negative_int)
    norm_dtype: str = attrs.field(default="float16", validator=attrs_one_of(NORM_DTYPES))

    @property
    def stage_bits(self) -> tuple[int, int]:
        """``(bits, residual_bits)``: code widths of the two stages."""
        return self.bits, self.residual_bits

    @property
    def norm_bits(self) -> int:
        """Bits of one stored norm (16 for float16, 32 for float32)."""
        return 16 if self.norm_dtype == "float16" else 32

    def rotated_dim(self, head_dim: int) -> int:
        """``D_pad``: the smallest Hadamard size ``>= head_dim`` unless the next power of two stores no more words
        per token (as ``turboquant``: :func:`~kvq_backends_turboquant.rotation.rotated_dim`)."""
        return rotated_dim_of(self, head_dim)

    def stored_words(self, dim: int) -> dict[str, int]:
        """uint32 words per token of ``codes`` and ``residual_codes`` at rotation size ``dim``."""
        return {"codes": packed_words(dim, self.bits), "residual_codes": packed_words(dim, self.residual_bits)}

    def check_head_dim(self, head_dim: int) -> None:
        """:raises ValueError: ``head_dim`` outside 1..1024 (zero-padded to :meth:`rotated_dim`)."""
        if not isinstance(head_dim, int) or not 1 <= head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"{self.method}: head_dim {head_dim!r} is not supported: it must be an int in "
                             f"1..{MAX_HEAD_DIM}")

    def codebooks(self, head_dim: int) -> tuple[mx.array, mx.array]:
        """``(c1, c2)``: float32 ``[2**bits]`` stage-1 centroids and float32 ``[2**residual_bits]`` residual
        centroids, both ascending, in rotated unit-vector units (multiply by the norm). A code pair decodes to
        ``c1[idx1] + c2[idx2]``. :raises ValueError: unsupported ``head_dim``."""
        self.check_head_dim(head_dim)
        dim = self.rotated_dim(head_dim)
        return codebook(dim, self.bits).centroids, residual_codebook(dim, self.bits, self.residual_bits).centroids

    def accounting(self, head_dim: int) -> kvq.BitsAccounting:
        """Per token: both packed code fields (whole uint32 words, as stored) and one norm; shared: the rotation and
        both codebooks (centroids and boundaries, float32). :raises ValueError: unsupported ``head_dim``."""
        self.check_head_dim(head_dim)
        dim = self.rotated_dim(head_dim)
        per_token = {**{name: 32 * words for name, words in self.stored_words(dim).items()}, "norms": self.norm_bits}
        shared = (rotation_of(self, head_dim).nbytes + codebook(dim, self.bits).nbytes
                  + residual_codebook(dim, self.bits, self.residual_bits).nbytes)
        return kvq.BitsAccounting(head_dim, per_token, shared)


def encode_rotated(y: mx.array, params: TurboQuantRVQParams) -> tuple[dict[str, mx.array], mx.array]:
    """Two-stage codes of rotated unit vectors ``y`` float32 ``[B, H, T, D_pad]``.

    :return: ``({"codes": uint32 [B, H, T, ceil(D_pad·bits/32)], "residual_codes": uint32 [..., ceil(D_pad·
        residual_bits/32)]}, y_hat)`` with ``y_hat = c1[idx1] + c2[idx2]`` float32 like ``y`` (lazy).
    """
    dim = y.shape[-1]
    first, second = codebook(dim, params.bits), residual_codebook(dim, params.bits, params.residual_bits)
    idx1 = first.encode(y)
    coarse = first.decode(idx1)
    idx2 = second.encode(y - coarse)
    fields = {"codes": pack_codes(idx1, params.bits), "residual_codes": pack_codes(idx2, params.residual_bits)}
    return fields, coarse + second.decode(idx2)


def unpack_codes(data, params: TurboQuantRVQParams, head_dim: int) -> tuple[mx.array, mx.array]:
    """``(idx1, idx2)``: uint32 ``[B, H, T, D_pad]`` codes of both stages, from the packed fields of ``data``.

    :raises ValueError: codes stored at another rotation size (:func:`~kvq_backends_turboquant.mse.
        check_stored_width`).
    """
    for name in ("codes", "residual_codes"):
        check_stored_width(data, name, params, head_dim)
    dim = params.rotated_dim(head_dim)
    return (packing.unpack(data["codes"], params.bits, dim),
            packing.unpack(data["residual_codes"], params.residual_bits, dim))


def decode_rotated(data, params: TurboQuantRVQParams, head_dim: int) -> mx.array:
    """``c1[idx1] + c2[idx2]``: float32 ``[B, H, T, D_pad]`` unit-vector estimates in the rotated domain."""
    idx1, idx2 = unpack_codes(data, params, head_dim)
    c1, c2 = params.codebooks(head_dim)
    return mx.take(c1, idx1) + mx.take(c2, idx2)
