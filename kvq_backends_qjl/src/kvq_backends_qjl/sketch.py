"""The random sketch matrices of QJL: Gaussian, or orthogonalised in blocks of ``dim`` rows.

QJL (Zandieh, Daliri, Han, arXiv 2406.03482) stores a key ``k`` as ``sign(S k)`` and ``‖k‖`` and estimates
``⟨q, k⟩`` by ``c / m · ‖k‖ · ⟨S q, sign(S k)⟩``. For a row ``s`` with i.i.d. N(0, 1) entries,
``E[⟨s, q⟩ sign⟨s, k⟩] = sqrt(2/π) ⟨q, k⟩ / ‖k‖``, so ``c = sqrt(π/2)`` makes the estimate unbiased.

The orthogonal sketch (the paper's code, ``QJLSketch.init_rot_dir``) takes each block of ``dim`` rows from
the QR decomposition of a Gaussian ``dim x dim`` matrix and scales the rows to norm ``sqrt(dim)``; rows of one
block are exactly orthogonal, which lowers the variance (REFERENCE_VALUES.md: about 2.8x). Each row is uniform
on the sphere of radius ``sqrt(dim)``, while a Gaussian row's norm averages ``E‖g‖ = sqrt(2) Γ((dim+1)/2) /
Γ(dim/2)`` (slightly below ``sqrt(dim)``), so the unbiased constant becomes ``c = sqrt(π/2) · E‖g‖ /
sqrt(dim)``. Leaving it at ``sqrt(π/2)`` biases scores by ``sqrt(dim) / E‖g‖ ≈ 1 + 1/(4 dim)``: 0.2% at
``dim`` 128, and 6% for a 4-channel outlier sketch.

Sketches are drawn with numpy's ``Generator`` from ``SeedSequence([seed, stream])`` (never global state), so
the same parameters give the same matrix in every process; QR runs in float64 before the cast to float32.
"""

from __future__ import annotations

import math
from functools import lru_cache

import attrs
import mlx.core as mx
import numpy as np
from kvq.validate import one_of

SKETCHES = ("orthogonal", "gaussian")
#: ``stream`` of the sketch of inlier channels and of the outlier sketch (independent random streams).
MAIN_STREAM, OUTLIER_STREAM = 0, 1


@attrs.frozen(eq=False)
class Sketch:
    """A sketch matrix and the constant of its unbiased inner-product estimator.

    :param matrix: float32 ``mx.array`` ``[rows, dim]`` (``S``; ``rows`` = sketch dimension ``m``).
    :param estimator_scale: ``c / m``: the estimate of ``⟨q, k⟩`` is
        ``estimator_scale · ‖k‖ · ⟨S q, sign(S k)⟩``.
    :param kind: ``"orthogonal"`` or ``"gaussian"``. :param seed: the seed it was drawn from.
    """

    matrix: mx.array
    estimator_scale: float
    kind: str
    seed: int

    @property
    def rows(self) -> int:
        """``m``, the number of sign bits per sketched vector."""
        return self.matrix.shape[0]

    @property
    def dim(self) -> int:
        """The dimension of the vectors it sketches."""
        return self.matrix.shape[1]


def expected_gaussian_norm(dim: int) -> float:
    """``E‖g‖`` for ``g ~ N(0, I_dim)``: ``sqrt(2) Γ((dim+1)/2) / Γ(dim/2)`` (about ``sqrt(dim - 1/2)``)."""
    return math.sqrt(2.0) * math.exp(math.lgamma((dim + 1) / 2) - math.lgamma(dim / 2))


def gaussian_rows(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
    """float64 ``[rows, dim]`` with i.i.d. N(0, 1) entries."""
    return rng.standard_normal((rows, dim))


def orthogonal_rows(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
    """float64 ``[rows, dim]``: blocks of ``dim`` orthogonal rows of norm ``sqrt(dim)`` (the last may be partial).

    Each block is ``Q`` of the QR decomposition of a Gaussian ``dim x dim`` matrix, with the signs of ``R``'s
    diagonal moved into ``Q`` so that ``Q`` is Haar-distributed (Mezzadri 2007).
    """
    blocks = []
    for start in range(0, rows, dim):
        q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
        q = q * np.where(np.diag(r) < 0, -1.0, 1.0)  # column signs: Haar measure
        blocks.append(q[: min(dim, rows - start)] * math.sqrt(dim))
    return np.concatenate(blocks, axis=0)


@lru_cache(maxsize=32)
def make_sketch(dim: int, rows: int, kind: str = "orthogonal", seed: int = 0, stream: int = MAIN_STREAM) -> Sketch:
    """The sketch for vectors of ``dim`` coordinates with ``rows`` sign bits (cached; the same in every process).

    :param dim: dimension of the sketched vectors (head_dim, or the number of outlier channels), >= 1.
    :param rows: sketch dimension ``m`` >= 1.
    :param kind: ``"orthogonal"`` (default; lower variance) or ``"gaussian"`` (i.i.d. N(0, 1), the paper's
        analysis).
    :param seed: non-negative int. :param stream: :data:`MAIN_STREAM` or :data:`OUTLIER_STREAM`.
    :return: :class:`Sketch` with a float32 ``[rows, dim]`` matrix.
    :raises ValueError: ``kind`` not one of :data:`SKETCHES`, or ``dim``/``rows`` below 1.
    """
    one_of("sketch", kind, SKETCHES)
    if dim < 1 or rows < 1:
        raise ValueError(f"make_sketch: dim and rows must be >= 1; got dim={dim}, rows={rows}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, stream]))
    if kind == "gaussian":
        matrix, c = gaussian_rows(rng, rows, dim), math.sqrt(math.pi / 2)
    else:
        matrix = orthogonal_rows(rng, rows, dim)
        c = math.sqrt(math.pi / 2) * expected_gaussian_norm(dim) / math.sqrt(dim)
    return Sketch(mx.array(matrix.astype(np.float32)), c / rows, kind, seed)
