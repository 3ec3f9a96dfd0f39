"""Parameters and bits accounting of ``qjl`` (Zandieh, Daliri, Han, arXiv 2406.03482).

Per token and head, ``qjl`` stores:

* ``signs``: ``sketch_dim`` sign bits of ``S k_in`` (``k_in``: the key with its outlier channels zeroed);
* ``norms``: ``‖k_in‖`` as float16;
* with ``outlier_channels = k > 0``: ``outlier_indices`` (the group's ``k`` outlier channels, uint8 for
  head_dim <= 256, else uint16), ``outlier_signs`` (``outlier_sketch_dim`` sign bits of ``S_o k_out``, where
  ``k_out`` is the ``k`` outlier coordinates) and ``outlier_norms`` (``‖k_out‖``, float16).

Outlier channels are chosen per group of ``group_size`` consecutive tokens of one quantize call (the paper's
code: groups of 32, the top-k channels by norm over the group). The group's indices are stored with each of
its tokens, because every field of an :class:`kvq.Encoded` has a token axis; the accounting counts them so.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
from kvq import BitsAccounting
from kvq.validate import attrs_one_of

from .sketch import SKETCHES

#: Bits of one stored float16 norm.
NORM_BITS = 16


def _int_at_least(low: int, multiple: int = 1, optional: bool = False):
    """attrs validator: an int >= ``low`` and a multiple of ``multiple`` (``None`` allowed if ``optional``)."""

    def validator(instance, attribute, value):
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < low or value % multiple:
            rule = f"an int >= {low}" + (f" and a multiple of {multiple}" if multiple > 1 else "")
            rule += " (or None for the default)" if optional else ""
            why = " (sign bits are packed 8 per byte)" if multiple == 8 else ""
            raise ValueError(f"{attribute.name} must be {rule}{why}; got {value!r}")

    return validator


@attrs.frozen(cache_hash=True)  # hashed on every decode step (selection and kernel-check keys)
class QJLParams:
    """Parameters of ``qjl``.

    :param sketch_dim: ``m``, sign bits per key, a positive multiple of 8. ``None`` (default): ``2 · head_dim``
        rounded up to a multiple of 8 (256 for head_dim 128, the paper's general-layer setting).
    :param sketch: ``"orthogonal"`` (default: rows orthogonalised in blocks of head_dim, lower variance) or
        ``"gaussian"`` (i.i.d. N(0, 1), the paper's analysis).
    :param outlier_channels: ``k``, channels per token group kept apart and sketched separately (0 = none);
        must be below head_dim. Default 4.
    :param outlier_sketch_dim: sign bits of the outlier sketch, a positive multiple of 8; ``None`` (default):
        ``8 · outlier_channels`` (32 for 4 channels: with indices and norm, 80 bits per token).
    :param group_size: tokens per outlier group (consecutive tokens of one quantize call; the last group of a
        call may be shorter). Default 32, as in the paper's code.
    :param seed: non-negative int seeding both sketches (reproducible across processes).
    :raises ValueError: any value out of range (the message names the parameter and what is allowed).
    """

    method: ClassVar[str] = "qjl"
    sketch_dim: int | None = attrs.field(default=None, validator=_int_at_least(8, 8, optional=True))
    sketch: str = attrs.field(default="orthogonal", validator=attrs_one_of(SKETCHES))
    outlier_channels: int = attrs.field(default=4, validator=_int_at_least(0))
    outlier_sketch_dim: int | None = attrs.field(default=None, validator=_int_at_least(8, 8, optional=True))
    group_size: int = attrs.field(default=32, validator=_int_at_least(1))
    seed: int = attrs.field(default=0, validator=_int_at_least(0))

    def block_tokens(self) -> int:
        """:class:`kvq.contract.EncodesBlocks`: outlier channels are chosen per ``group_size`` tokens, so a cache
        compresses whole groups (1 without outlier channels)."""
        return self.group_size if self.outlier_channels else 1

    def sketch_dim_for(self, head_dim: int) -> int:
        """``m`` for keys of ``head_dim``: ``sketch_dim``, or ``2 · head_dim`` rounded up to a multiple of 8."""
        return self.sketch_dim if self.sketch_dim is not None else -(-2 * head_dim // 8) * 8

    @property
    def resolved_outlier_sketch_dim(self) -> int:
        """Sign bits of the outlier sketch (0 without outlier channels)."""
        if self.outlier_channels == 0:
            return 0
        return self.outlier_sketch_dim if self.outlier_sketch_dim is not None else 8 * self.outlier_channels

    def index_bits(self, head_dim: int) -> int:
        """Bits of one stored outlier channel index: 8 (uint8) up to head_dim 256, else 16."""
        return 8 if head_dim <= 256 else 16

    def accounting(self, head_dim: int) -> BitsAccounting:
        """Bits per token and head of every stored field; the float32 sketch matrices are shared bytes.

        :raises ValueError: as :meth:`check_head_dim`.
        """
        self.check_head_dim(head_dim)
        m, k = self.sketch_dim_for(head_dim), self.outlier_channels
        per_token = {"signs": m, "norms": NORM_BITS}
        if k:
            per_token.update(outlier_indices=k * self.index_bits(head_dim),
                             outlier_signs=self.resolved_outlier_sketch_dim, outlier_norms=NORM_BITS)
        shared = 4 * (m * head_dim + self.resolved_outlier_sketch_dim * k)
        return BitsAccounting(head_dim, per_token, shared_bytes=shared)

    def check_head_dim(self, head_dim: int) -> None:
        """Any head_dim >= 1 works (no Hadamard, so no power of two needed), if it exceeds ``outlier_channels``.

        :raises ValueError: ``head_dim`` < 1 or ``head_dim <= outlier_channels``.
        """
        if head_dim < 1 or head_dim <= self.outlier_channels:
            raise ValueError(f"qjl: head_dim {head_dim} is not supported: it must exceed "
                             f"outlier_channels={self.outlier_channels}")
