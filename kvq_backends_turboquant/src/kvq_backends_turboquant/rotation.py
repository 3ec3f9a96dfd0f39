"""Seeded random rotations of the (zero-padded) head dimension, and the QJL sketch matrix.

TurboQuant (Zandieh et al., arXiv 2504.19874) multiplies every vector by a random rotation so that each coordinate
follows the same known distribution. Two rotations are offered:

* ``"hadamard"`` (default): random ±1 signs, then the fast Walsh-Hadamard transform normalised by
  ``1/sqrt(D_pad)`` (``mx.hadamard_transform``): ``O(D log D)`` per vector and ``D_pad`` signs of state.
* ``"qr"``: a dense Haar-random orthogonal matrix (QR of a Gaussian matrix, signs fixed by ``diag(R)``), for
  checks; ``O(D²)`` per vector.

The rotation acts on ``D_pad >= head_dim`` coordinates (the vector zero-padded; a Hadamard of the wrong size is a
known pitfall). ``mx.hadamard_transform`` has the sizes ``m · 2^k`` for ``m`` in 1, 12, 20, 28, so 80 (20 · 4), 96
(12 · 8) and 112 (28 · 4) need no padding. :func:`rotated_dim` picks ``D_pad`` for a method's stored layout: the
smallest such size, unless the next power of two stores no more packed words per token (then the power of two:
more rotated coordinates for the same bytes, the layout kvq 0.1.0 wrote, and the one the fused kernels serve). The
two channel groups of data-chosen mixed precision (:mod:`~kvq_backends_turboquant.outliers`) are rotated at
:func:`group_dim`, and ``qr`` has every size. MLX's Hadamard matrices of sizes ``20 · 2^k`` and ``28 · 2^k`` are
not symmetric: their inverse is applied as a dense matrix (:meth:`Rotation.inverse`).
Every constant comes from ``numpy.random.default_rng`` seeded with ``(seed, D_pad, purpose)``, never from global
state, so every process builds the same matrices.
"""

from __future__ import annotations

from functools import lru_cache

import attrs
import mlx.core as mx
import numpy as np

ROTATIONS = ("hadamard", "qr")
_PURPOSE_ROTATION, _PURPOSE_SKETCH, _PURPOSE_OUTLIER_ROTATION = 1, 2, 3
#: Odd factors ``m`` of the Hadamard sizes ``m · 2^k`` that ``mx.hadamard_transform`` supports.
HADAMARD_FACTORS = (1, 12, 20, 28)


def power_of_two_dim(head_dim: int) -> int:
    """The smallest power of two ``>= head_dim`` (at least 2, the smallest sphere with a density): the rotation size
    kvq 0.1.0 used for every head_dim, and the only kind the fused kernels serve."""
    return 1 << max(1, (head_dim - 1).bit_length())


def rotated_dim(head_dim: int, words, at_least: int = 0) -> int:
    """``D_pad`` of a layout: :func:`hadamard_size` ``(max(head_dim, at_least))`` (the smallest Hadamard size, 12,
    20 and 28 left out), unless :func:`power_of_two_dim` ``(head_dim)`` stores no more words per token; then that
    power of two. The same for both rotations (``qr`` has every size), so the layout and the accounting do not
    depend on the rotation.

    :param words: ``dim -> packed uint32 words per token`` of the method's code fields at rotation size ``dim``.
    :param at_least: coordinates the rotated vector must have (``outlier_channels``), at most the power of two.
    """
    power, smallest = power_of_two_dim(head_dim), hadamard_size(max(head_dim, at_least), odd_alone=False)
    return smallest if words(smallest) < words(power) else power


def hadamard_size(n: int, odd_alone: bool = True) -> int:
    """The smallest ``m · 2^k >= n`` (``m`` in :data:`HADAMARD_FACTORS`), at least 2. ``odd_alone=False`` leaves
    out 12, 20 and 28 themselves (``k = 0``), which MLX 0.32's CUDA ``hadamard_transform`` fails to compile."""
    n = max(n, 2)
    return min(m << max(int(m > 1 and not odd_alone), (-(-n // m) - 1).bit_length()) for m in HADAMARD_FACTORS)


def group_dim(channels: int, kind: str) -> int:
    """Rotation size for a group of ``channels`` coordinates: the smallest ``m · 2^k >= channels`` (``m`` in
    :data:`HADAMARD_FACTORS`) for ``"hadamard"``, ``channels`` itself for ``"qr"``; at least 2."""
    return max(channels, 2) if kind == "qr" else hadamard_size(channels)


def _is_hadamard_size(dim: int) -> bool:
    return any(dim % m == 0 and (dim // m) & (dim // m - 1) == 0 for m in HADAMARD_FACTORS)


def _rng(seed: int, dim: int, purpose: int) -> np.random.Generator:
    return np.random.default_rng([seed, dim, purpose])


@attrs.frozen(eq=False)
class Rotation:
    """An orthogonal map of ``R^D_pad``, applied along the last axis.

    :param kind: ``"hadamard"`` or ``"qr"``. :param dim: ``D_pad``, a Hadamard size ``m · 2^k``.
    :param signs: float32 ``[D_pad]`` random ±1 (``hadamard``), or ``None``.
    :param matrix: float32 ``[D_pad, D_pad]`` orthogonal ``Π`` (``qr``; and ``hadamard`` at the sizes whose
        Hadamard matrix is not symmetric, for the inverse), or ``None``.
    """

    kind: str
    dim: int
    signs: mx.array | None = None
    matrix: mx.array | None = None

    def forward(self, x: mx.array) -> mx.array:
        """``Π x``: float32 ``[..., D]`` with ``D <= D_pad`` (zero-padded here) -> float32 ``[..., D_pad]``."""
        pad = self.dim - x.shape[-1]
        if pad:
            x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
        if self.kind == "qr":
            return x @ self.matrix.T
        return _hadamard(x * self.signs)

    def inverse(self, y: mx.array) -> mx.array:
        """``Πᵀ y``: float32 ``[..., D_pad]`` -> ``[..., D_pad]`` (the caller drops the padding)."""
        if self.matrix is not None:  # qr, and Hadamard sizes 20 · 2^k, 28 · 2^k: y @ Π is Πᵀ y for row vectors
            return y @ self.matrix
        # the normalised Sylvester Hadamard matrix (and MLX's 12 · 2^k) is symmetric and orthogonal: its own inverse
        return _hadamard(y) * self.signs

    def dense(self) -> mx.array:
        """``Π`` as a float32 ``[D_pad, D_pad]`` matrix (tests, and checks of orthogonality)."""
        return self.forward(mx.eye(self.dim)).T

    @property
    def nbytes(self) -> int:
        """Bytes of resident state (a shared constant, reported apart from per-token bits)."""
        return sum(a.nbytes for a in (self.signs, self.matrix) if a is not None)


def _hadamard(x: mx.array) -> mx.array:
    """Normalised fast Walsh-Hadamard transform along the last axis (empty blocks, T = 0, pass through)."""
    return mx.hadamard_transform(x, scale=x.shape[-1] ** -0.5) if x.size else x


@lru_cache(maxsize=None)
def rotation(kind: str, dim: int, seed: int, outlier_group: bool = False) -> Rotation:
    """The seeded rotation of ``R^dim`` (cached per process).

    :param kind: one of :data:`ROTATIONS`. :param dim: ``D_pad`` (:func:`rotated_dim`), or a :func:`group_dim`.
    :param seed: int >= 0. :param outlier_group: draw the independent rotation of the outlier channel group of
        data-chosen mixed precision (another stream of the same seed).
    :raises ValueError: unknown ``kind``, or ``dim`` not a Hadamard size ``m · 2^k`` (``hadamard``) or below 1.
    """
    if kind not in ROTATIONS:
        raise ValueError(f"rotation must be one of {', '.join(ROTATIONS)}; got {kind!r}")
    if dim < 1 or (kind == "hadamard" and not _is_hadamard_size(dim)):
        raise ValueError(f"dim must be a power of two or m · 2^k with m in 12, 20, 28 (a padded head_dim or "
                         f"channel group); got {dim}")
    rng = _rng(seed, dim, _PURPOSE_OUTLIER_ROTATION if outlier_group else _PURPOSE_ROTATION)
    if kind == "hadamard":
        signs = (rng.integers(0, 2, size=dim) * 2.0 - 1.0).astype(np.float32)
        matrix = None if dim & (dim - 1) == 0 else _dense_if_asymmetric(dim, signs)
        return Rotation(kind, dim, signs=mx.array(signs), matrix=matrix)
    q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
    q = q * np.sign(np.diag(r))[None, :]  # makes the distribution Haar (uniform over rotations)
    return Rotation(kind, dim, matrix=mx.array(q.astype(np.float32)))


def _dense_if_asymmetric(dim: int, signs: np.ndarray) -> mx.array | None:
    """``Π = H diag(signs)`` float32 ``[dim, dim]`` where MLX's Hadamard matrix of size ``dim`` is not symmetric
    (``20 · 2^k``, ``28 · 2^k``), else ``None``."""
    H = np.array(_hadamard(mx.eye(dim))).T  # column j is H e_j
    return None if np.allclose(H, H.T) else mx.array((H * signs[None, :]).astype(np.float32))


@lru_cache(maxsize=None)
def sketch_matrix(dim: int, seed: int) -> mx.array:
    """QJL's ``S``: float32 ``[dim, dim]`` with i.i.d. N(0, 1) entries, seeded (TurboQuant-prod, section 3.2).

    It acts in the rotated domain; a Gaussian matrix times a rotation is again i.i.d. Gaussian, so this is the
    same estimator as a sketch of the unrotated residual.
    """
    return mx.array(_rng(seed, dim, _PURPOSE_SKETCH).standard_normal((dim, dim)).astype(np.float32))
