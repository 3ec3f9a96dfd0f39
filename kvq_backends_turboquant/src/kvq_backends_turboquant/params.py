"""Parameters and bits accounting of ``turboquant`` and ``turboquant_prod`` (Zandieh et al., arXiv 2504.19874).

Both methods rotate each vector (zero-padded to ``D_pad`` coordinates: :meth:`_Params.rotated_dim`) and quantize
every rotated coordinate with the Lloyd-Max codebook of that dimension. Stored per token and head:

* ``turboquant``: ``D_pad`` codes of ``bits`` bits, and the vector's norm.
* ``turboquant_prod``: ``D_pad`` codes of ``bits - 1`` bits (none at 1 bit), ``D_pad`` QJL sign bits of the
  residual, the vector's norm and the residual's norm.

Mixed precision (the paper's fractional settings, e.g. 2.5 and 3.5 bits), two ways (``outlier_select``):

* ``"rotated"`` (default): the first ``outlier_channels`` coordinates *of the rotated vector* use ``outlier_bits``
  instead of ``bits``. After the random rotation all coordinates are exchangeable, so a fixed set costs no index
  bits and has the same expected error as any other set: ``(k * D_mse(outlier_bits) + (D_pad - k) *
  D_mse(bits)) / D_pad`` for unit vectors (before the padding is dropped). Storing a per-token choice instead
  would cost ``k * log2(D)`` bits (1.75 bits per coordinate for k = 32, D = 128).
* ``"data"`` (``turboquant`` only): as the paper does, ``outlier_channels`` channels *of the original vector* are
  chosen per KV head from data and the two channel sets are quantized by two independent TurboQuant instances
  (:mod:`~kvq_backends_turboquant.outliers`). The choice is per-layer shared state held by the parameters
  (``outlier_indices``, set by :meth:`TurboQuantParams.fit` on the first block the cache compresses, or given),
  stored once per layer and head, saved with prompt-cache files; ``quantize`` stays stateless.
"""

from __future__ import annotations

from functools import lru_cache
from typing import ClassVar

import attrs

import kvq
from kvq.packing import packed_words
from kvq.validate import attrs_one_of, one_of

from . import codebook as codebook_module
from . import outliers
from .rotation import ROTATIONS, power_of_two_dim, rotated_dim, rotation

BITS = (1, 2, 3, 4)
NORM_DTYPES = ("float16", "float32")
#: Largest head_dim accepted (rotated at most at 1024; the largest in use is 576, rotated at 640).
MAX_HEAD_DIM = 1024


def _non_negative_int(instance, attribute, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name} must be an int >= 0; got {value!r}")


#: What :func:`_check_bits` adds to its error: where a fraction of a bit goes.
BUDGET_HINT = ("; a number with a fraction, such as 3.5, is a bits budget per layer for a whole cache: "
               "the method string turboquant:3.5, or the cache's bits=3.5 (kvq.make_prompt_cache(model, "
               "'turboquant', bits=3.5); kvq generate and kvq serve: --bits 3.5)")


def _check_bits(method: str, value) -> None:
    """:func:`kvq.validate.one_of` of ``bits`` of ``method`` (the parameters class's), naming the budget a
    fractional ``bits`` would have meant."""
    try:
        one_of("bits", value, BITS, method)
    except ValueError as error:
        raise ValueError(f"{error} (turboquant's codes take whole bits{BUDGET_HINT})") from None


def _bits(instance, attribute, value) -> None:
    _check_bits(type(instance).method, value)


def _default_outlier_bits(self) -> int:
    _check_bits(type(self).method, self.bits)  # before the validators run: a bad bits gets their message
    return min(self.bits + 1, BITS[-1])


@attrs.frozen
class _Params:
    """Fields shared by both variants (see the subclasses for their meaning)."""

    bits: int = attrs.field(default=4, validator=_bits)
    rotation: str = attrs.field(default="hadamard", validator=attrs_one_of(ROTATIONS))
    seed: int = attrs.field(default=0, validator=_non_negative_int)
    outlier_channels: int = attrs.field(default=0, validator=_non_negative_int)
    outlier_bits: int = attrs.field(default=attrs.Factory(_default_outlier_bits, takes_self=True),
                                    validator=attrs_one_of(BITS))
    norm_dtype: str = attrs.field(default="float16", validator=attrs_one_of(NORM_DTYPES))

    @property
    def stage_bits(self) -> tuple[int, int]:
        """``(regular, outlier)`` code bits of the Lloyd-Max stage; 0 means that group stores no codes."""
        raise NotImplementedError

    def check_head_dim(self, head_dim: int) -> None:
        """:raises ValueError: ``head_dim`` outside 1..1024, or ``outlier_channels`` above the next power of two."""
        if not isinstance(head_dim, int) or not 1 <= head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"{self.method}: head_dim {head_dim!r} is not supported: it must be an int in "
                             f"1..{MAX_HEAD_DIM}")
        if self.outlier_channels > power_of_two_dim(head_dim):
            raise ValueError(f"outlier_channels must be at most {power_of_two_dim(head_dim)}, the next power of two "
                             f"of head_dim {head_dim}; got {self.outlier_channels}")

    def budget_options(self, head_dim: int) -> list:
        """The settings a bits budget may pick at ``head_dim`` (:class:`kvq.contract.SpendsBudget`,
        :mod:`kvq.cache.budget`), fewest bits first: each stores more bits per token (whole packed words) than the
        one before and has a smaller expected error, ``(k * D_mse(outlier_bits) + (D_pad - k) * D_mse(bits)) /
        D_pad`` (the module docstring; settings that store more for no less error are left out). They are every
        ``bits`` of :data:`BITS` alone, and ``bits`` with the first ``k`` rotated coordinates one bit wider or
        narrower, ``k`` a multiple of 8: mixed precision that costs no index bits (rotated coordinates are
        exchangeable). Other fields as in ``self``.

        :raises ValueError: a head_dim these parameters do not support, or ``outlier_select="data"`` (its channel
            sets are fitted from data, which a budget chosen at construction cannot know).
        """
        if getattr(self, "outlier_select", "rotated") != "rotated":
            raise ValueError(f"{self.method}: a bits budget chooses rotated coordinates (outlier_select='rotated'); "
                             f"got outlier_select={self.outlier_select!r}")
        self.check_head_dim(head_dim)
        scored = []
        for k in range(0, power_of_two_dim(head_dim), 8):
            for bits in BITS:
                for other in ((bits - 1, bits + 1) if k else (bits,)):
                    if other not in BITS:
                        continue
                    option = attrs.evolve(self, bits=bits, outlier_bits=other, outlier_channels=k)
                    dim = option.rotated_dim(head_dim)
                    error = sum(n * _unit_mse(dim, b) for _, n, b in option.groups(head_dim)) / dim
                    scored.append((option.accounting(head_dim).bits_per_token, error, k, option))
        options, best = [], float("inf")
        for _, error, _, option in sorted(scored, key=lambda s: s[:3]):
            if error < best:
                options.append(option)
                best = error
        return options

    def rotated_dim(self, head_dim: int) -> int:
        """``D_pad``, the coordinates of the rotated vector: the smallest Hadamard size ``m · 2^k >= head_dim`` (``m``
        in 1, 12, 20, 28; 80, 96 and 112 are their own), unless the next power of two stores no more words per
        token (:func:`~kvq_backends_turboquant.rotation.rotated_dim`). Powers of two are their own ``D_pad``."""
        return rotated_dim_of(self, head_dim, self.outlier_channels)

    def stored_words(self, dim: int) -> dict[str, int]:
        """uint32 words per token of each code field at rotation size ``dim`` (fields that store nothing left out)."""
        return {name: packed_words(n, b) for name, n, b in self._groups_at(dim) if n and b}

    def groups(self, head_dim: int) -> tuple[tuple[str, int, int], ...]:
        """``(field, coordinates, bits)`` of both code groups, in rotated-coordinate order: ``outlier_codes`` (the
        first ``outlier_channels`` coordinates) and ``codes`` (the rest of :meth:`rotated_dim`). A group with 0
        coordinates or 0 bits stores nothing (its coordinates decode to 0)."""
        return self._groups_at(self.rotated_dim(head_dim))

    def _groups_at(self, dim: int) -> tuple[tuple[str, int, int], ...]:
        regular, outlier = self.stage_bits
        k = self.outlier_channels
        return (("outlier_codes", k, outlier), ("codes", dim - k, regular))

    @property
    def norm_bits(self) -> int:
        """Bits of one stored norm (16 for float16, 32 for float32)."""
        return 16 if self.norm_dtype == "float16" else 32

    def _per_token(self, head_dim: int) -> dict[str, float]:
        # packed words, exactly as the arrays hold them (a partial last word costs a whole word)
        bits = {name: 32 * words for name, words in self.stored_words(self.rotated_dim(head_dim)).items()}
        return {**bits, "norms": self.norm_bits}

    def _shared_bytes(self, head_dim: int) -> int:
        dim = self.rotated_dim(head_dim)
        tables = {b for _, n, b in self.groups(head_dim) if n and b}
        return rotation(self.rotation, dim, self.seed).nbytes + sum(
            codebook_module.codebook(dim, b).nbytes for b in tables)


def _unit_mse(dim: int, bits: int) -> float:
    """``D_mse`` of a unit vector at rotation size ``dim`` with ``bits``-bit codes (1.0 for 0 bits: nothing kept)."""
    return codebook_module.codebook(dim, bits).mse if bits else 1.0


@lru_cache(maxsize=1024)
def rotated_dim_of(params, head_dim: int, at_least: int = 0) -> int:
    """:func:`~kvq_backends_turboquant.rotation.rotated_dim` with ``params.stored_words`` (any parameters of the
    family), cached: it is asked on every decode step, for every block."""
    return rotated_dim(head_dim, lambda dim: sum(params.stored_words(dim).values()), at_least)


def _indices(value):
    """``outlier_indices`` as given (lists from a JSON file, tuples, arrays) -> tuple of tuples of ints, or None."""
    if value is None:
        return None
    try:
        return tuple(tuple(int(c) for c in row) for row in value)
    except (TypeError, ValueError):
        raise ValueError(f"outlier_indices must be one sequence of channel indices per KV head; got {value!r}") \
            from None


def _indices_repr(value) -> str:
    return "None" if value is None else f"<{len(value)} heads x {len(value[0]) if value else 0} channels>"


@attrs.frozen(cache_hash=True)  # hashed on every decode step (selection and kernel-check keys)
class TurboQuantParams(_Params):
    """Parameters of ``turboquant`` (TurboQuant-mse, Zandieh et al., arXiv 2504.19874, algorithm 1).

    :param bits: code width per rotated coordinate, 1..4 (default 4).
    :param rotation: ``"hadamard"`` (randomized fast Walsh-Hadamard, default) or ``"qr"`` (dense, for checks).
    :param seed: int >= 0 seeding the rotation (same seed, same rotation in every process).
    :param outlier_channels: number of rotated coordinates quantized with ``outlier_bits`` (0 = off); at most the
        next power of two of head_dim (the rotation size is then at least this). E.g. ``bits=2,
        outlier_channels=64, outlier_bits=3`` at head_dim 128 stores 2.5 bits of codes per coordinate.
    :param outlier_bits: code width of those coordinates, 1..4 (default ``min(bits + 1, 4)``).
    :param norm_dtype: ``"float16"`` (default) or ``"float32"``: storage of the per-vector norm (computed in
        float32; float16 saturates at 65504).
    :param outlier_select: ``"rotated"`` (default: a fixed set of rotated coordinates) or ``"data"`` (channels of
        the original vectors chosen from data, two TurboQuant instances; the paper's setting): see the module
        docstring. With ``"data"``, ``outlier_channels`` must be in ``1..head_dim - 1``. The paper's split is
        ``bits=2, outlier_bits=3, outlier_channels=head_dim/4`` (printed there as 2.5 bits; its codes average
        2.25); ``outlier_channels=head_dim/2`` gives exactly 2.5 (and 3.5 with ``bits=3, outlier_bits=4``).
    :param outlier_statistic: how ``fit`` ranks channels: ``"second_moment"`` (mean ``x²``, default) or
        ``"mean_abs"``.
    :param outlier_indices: ``None`` until fitted, or one ascending tuple of ``outlier_channels`` distinct channel
        indices per KV head (from :meth:`fit` or from calibration); only with ``outlier_select="data"``.
    :raises ValueError: any value outside those ranges (the message names the parameter and what is allowed).
    """

    method: ClassVar[str] = "turboquant"

    outlier_select: str = attrs.field(default="rotated", validator=attrs_one_of(outliers.SELECTS))
    outlier_statistic: str = attrs.field(default="second_moment", validator=attrs_one_of(outliers.STATISTICS))
    outlier_indices: tuple | None = attrs.field(default=None, converter=_indices, repr=_indices_repr)

    def __attrs_post_init__(self) -> None:
        if self.outlier_select != "data":
            if self.outlier_indices is not None:
                raise ValueError("outlier_indices are only used with outlier_select='data'; got outlier_select="
                                 f"{self.outlier_select!r}")
            return
        if self.outlier_channels < 1:
            raise ValueError("outlier_select='data' needs outlier_channels >= 1 (how many channels to choose); "
                             f"got {self.outlier_channels}")
        for head, row in enumerate(self.outlier_indices or ()):
            if len(row) != self.outlier_channels or list(row) != sorted(set(row)) or (row and row[0] < 0):
                raise ValueError(f"outlier_indices: head {head} must list {self.outlier_channels} distinct "
                                 f"channel indices >= 0 in ascending order; got {row}")

    @property
    def data_chosen(self) -> bool:
        """True for ``outlier_select="data"``: two channel groups, each its own TurboQuant instance."""
        return self.outlier_select == "data"

    def check_head_dim(self, head_dim: int) -> None:
        """:raises ValueError: as :meth:`_Params.check_head_dim`; with ``outlier_select="data"`` also
        ``outlier_channels`` not below ``head_dim`` or ``outlier_indices`` beyond it."""
        super().check_head_dim(head_dim)
        if not self.data_chosen:
            return
        if self.outlier_channels >= head_dim:
            raise ValueError(f"outlier_select='data': outlier_channels must be below head_dim {head_dim}; got "
                             f"{self.outlier_channels}")
        if self.outlier_indices and max(row[-1] for row in self.outlier_indices) >= head_dim:
            raise ValueError(f"outlier_indices: channel indices must be below head_dim {head_dim}")

    def fit(self, block):
        """The shared state of ``outlier_select="data"``, chosen from the first block of keys or values a layer
        compresses: these parameters with ``outlier_indices`` set (:func:`~kvq_backends_turboquant.outliers.
        choose_channels`). Parameters that are fitted already, or use no data, are returned unchanged.

        The cache (:class:`kvq.cache.KVQCache`) calls ``fit`` once per layer, before quantizing its first block
        (:class:`kvq.contract.Fits`).
        :param block: ``[B, H_kv, T, D]`` float. :raises ValueError: an empty block, or bad ``outlier_channels``.
        """
        if not self.data_chosen or self.outlier_indices is not None:
            return self
        self.check_head_dim(block.shape[-1])
        chosen = outliers.choose_channels(block, self.outlier_channels, self.outlier_statistic)
        return attrs.evolve(self, outlier_indices=chosen)

    def unfitted(self):
        """These parameters without fitted state (what a user asks for; used to compare prompt-cache files:
        :class:`kvq.contract.Unfits`)."""
        return attrs.evolve(self, outlier_indices=None) if self.outlier_indices is not None else self

    def for_heads(self, start: int, stop: int):
        """Tensor parallelism: the fitted channel sets of KV heads ``start:stop`` (unfitted parameters unchanged;
        :class:`kvq.contract.ForHeads`)."""
        if self.outlier_indices is None:
            return self
        return attrs.evolve(self, outlier_indices=self.outlier_indices[start:stop])

    @property
    def stage_bits(self) -> tuple[int, int]:
        """``(bits, outlier_bits)``: the whole budget goes to the Lloyd-Max codes."""
        return self.bits, self.outlier_bits

    def accounting(self, head_dim: int) -> kvq.BitsAccounting:
        """Per token: the packed codes of ``D_pad`` rotated coordinates and one norm; shared: rotation and codebooks.
        With ``outlier_select="data"``: both groups' codes and norms; shared: their rotations and codebooks and
        the fitted channel permutation (:func:`~kvq_backends_turboquant.outliers.accounting`).

        :raises ValueError: unsupported ``head_dim`` (see :meth:`check_head_dim`).
        """
        self.check_head_dim(head_dim)
        if self.data_chosen:
            return kvq.BitsAccounting(head_dim, *outliers.accounting(self, head_dim))
        return kvq.BitsAccounting(head_dim, self._per_token(head_dim), self._shared_bytes(head_dim))


@attrs.frozen(cache_hash=True)  # hashed on every decode step (selection and kernel-check keys)
class TurboQuantProdParams(_Params):
    """Parameters of ``turboquant_prod`` (TurboQuant-prod, arXiv 2504.19874, algorithm 2): unbiased inner products.

    ``bits`` is the total per coordinate: the MSE stage uses ``bits - 1`` (and ``outlier_bits - 1`` on the
    outlier coordinates), and a 1-bit QJL sketch of the residual (``S`` i.i.d. N(0, 1), ``D_pad x D_pad``,
    seeded by ``seed``) plus the residual's norm make the estimate unbiased. Fields and errors as
    :class:`TurboQuantParams`.
    """

    method: ClassVar[str] = "turboquant_prod"

    @property
    def stage_bits(self) -> tuple[int, int]:
        """``(bits - 1, outlier_bits - 1)``: one bit per coordinate goes to the QJL sketch."""
        return self.bits - 1, self.outlier_bits - 1

    def stored_words(self, dim: int) -> dict[str, int]:
        """As :meth:`_Params.stored_words`, and ``signs``: ``dim`` QJL sign bits of the residual."""
        return {**super().stored_words(dim), "signs": packed_words(dim, 1)}

    def accounting(self, head_dim: int) -> kvq.BitsAccounting:
        """Per token: MSE-stage codes, ``D_pad`` sign bits, the norm and the residual norm; shared: rotation,
        codebooks and ``S`` (float32).

        :raises ValueError: unsupported ``head_dim`` (see :meth:`check_head_dim`).
        """
        self.check_head_dim(head_dim)
        dim = self.rotated_dim(head_dim)
        per_token = {**self._per_token(head_dim), "residual_norms": self.norm_bits}
        return kvq.BitsAccounting(head_dim, per_token, self._shared_bytes(head_dim) + 4 * dim * dim)
