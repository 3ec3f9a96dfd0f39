"""Lloyd-Max codebooks for the residual of TurboQuant's scalar quantizer (stage 2 of ``turboquant_rvq``).

Stage 1 quantizes a rotated unit-vector coordinate ``x`` (density ``f(x) ∝ (1 - x²)^((d - 3)/2)`` on ``[-1, 1]``,
see :mod:`~kvq_backends_turboquant.codebook`) with its Lloyd-Max codebook ``c1`` of ``bits`` bits. Stage 2
quantizes the residual ``r = x - c1[idx1(x)]`` with the Lloyd-Max codebook ``c2`` of the residual's own density

    ``g(r) = Σ_i f(c1_i + r) · 1[c1_i + r ∈ cell_i]``

(a mixture of the stage-1 cells, shifted onto their centroids; even, since ``f`` and ``c1`` are symmetric). This
is residual vector quantization (Juang & Gray, ICASSP 1982) applied per coordinate after TurboQuant's rotation
(Zandieh et al., arXiv 2504.19874). Every integral of ``g`` over a stage-2 cell splits into integrals of ``f`` over
sub-intervals of the stage-1 cells, computed like stage 1's (``x = sin θ``, Gauss-Legendre in ``θ``, machine
precision); Lloyd's iteration then runs on those exact cell masses and moments.

Codebooks are cached in memory and on disk beside the stage-1 ones (:func:`~kvq_backends_turboquant.codebook.
cached`), keyed by ``(dim, bits, residual_bits)``.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from . import codebook as stage1
from .codebook import FORMAT_VERSION, Codebook

_TOLERANCE = 1e-12  # in units of the residual's standard deviation
_MAX_ITERATIONS = 20000
_GRID_BINS = 1024
_GRID_NODES = np.polynomial.legendre.leggauss(16)  # a grid bin is small: 16 nodes are ample for the search


def _moments(lo: np.ndarray, hi: np.ndarray, dim: int, rule=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unnormalised ``∫ x^k (1 - x²)^((dim-3)/2) dx`` over ``[lo, hi]`` for ``k = 0, 1, 2`` (arrays of the same
    shape, ``-1 <= lo <= hi <= 1``), by Gauss-Legendre quadrature in ``θ = arcsin x`` (``rule``: ``(nodes,
    weights)``, default stage 1's 200-node rule)."""
    nodes, weights = rule or (stage1._NODES, stage1._WEIGHTS)
    a, b = np.arcsin(lo)[..., None], np.arcsin(hi)[..., None]
    theta = (b - a) / 2 * nodes + (b + a) / 2
    weight = (b - a) / 2 * weights * np.exp((dim - 2) * np.log(np.cos(theta)))
    sine = np.sin(theta)
    return weight.sum(-1), (weight * sine).sum(-1), (weight * sine * sine).sum(-1)


class _Residual:
    """The residual density of one stage-1 codebook: its cells, and integrals over stage-2 cells."""

    def __init__(self, dim: int, bits: int) -> None:
        self.dim = dim
        self.c1, _ = stage1.load_or_compute(dim, bits)
        edges = np.concatenate([[-1.0], (self.c1[1:] + self.c1[:-1]) / 2, [1.0]])
        self.lo, self.hi = edges[:-1, None], edges[1:, None]
        m0, m1, m2 = _moments(self.lo[:, 0], self.hi[:, 0], dim)
        self.total = m0.sum()
        # E[r²] = Σ_i ∫_cell_i (x - c1_i)² f(x) dx
        self.variance = float(np.sum(m2 - 2 * self.c1 * m1 + self.c1**2 * m0) / self.total)

    def pieces(self, edges: np.ndarray, rule=None):
        """``(m0, m1, m2)`` ``[levels]``: mass, first and second moment of ``r`` in each residual cell
        ``[edges[j], edges[j + 1]]`` (ascending; residuals lie in ``[-2, 2]``). Stage-1 cell ``i`` contributes the
        integral of ``f`` over ``x ∈ cell_i`` with ``x - c1_i`` in the residual cell."""
        shift = self.c1[:, None]
        lo = np.clip(shift + edges[None, :-1], self.lo, self.hi)
        hi = np.clip(shift + edges[None, 1:], self.lo, self.hi)
        m0, m1, m2 = np.zeros((3, *lo.shape))  # moments of x, [2**bits, levels]; most pieces are empty
        used = lo < hi
        m0[used], m1[used], m2[used] = _moments(lo[used], hi[used], self.dim, rule)
        r1 = m1 - shift * m0
        r2 = m2 - 2 * shift * m1 + shift**2 * m0
        return m0.sum(0) / self.total, r1.sum(0) / self.total, r2.sum(0) / self.total

    def cells(self, centroids: np.ndarray):
        """``(m0, m1, m2)`` of the Voronoi cells of the residual ``centroids``."""
        return self.pieces(np.concatenate([[-2.0], (centroids[1:] + centroids[:-1]) / 2, [2.0]]))

    def mse(self, centroids: np.ndarray) -> float:
        """``dim · E[(r - q(r))²]``: the total squared error of both stages for a unit vector."""
        m0, m1, m2 = self.cells(centroids)
        return float(self.dim * np.sum(m2 - 2 * centroids * m1 + centroids**2 * m0))

    def grid(self) -> np.ndarray:
        """:data:`_GRID_BINS` + 1 ascending bin edges from -2 to 2, dense near 0 where the residual's mass is.

        They span every stage-1 cell's half-width and the outer cells' residuals up to ``|x| = 7/sqrt(dim)``
        (the mass beyond, below 1e-11, falls into the two end bins), uniform in ``sinh(3 u)``.
        """
        half_widths = (self.hi[:, 0] - self.lo[:, 0])[1:-1] / 2
        tail = 7.0 / np.sqrt(self.dim) - self.c1[-1]
        reach = min(2.0, max(tail, *half_widths, self.c1[-1] - self.lo[-1, 0]))
        edges = reach * np.sinh(3 * np.linspace(-1, 1, _GRID_BINS + 1)) / np.sinh(3)
        edges[0], edges[-1] = -2.0, 2.0
        return edges

    def global_start(self, levels: int) -> np.ndarray:
        """Centroids of the optimal partition of a fine grid of residual bins into ``levels`` intervals.

        ``g`` is not log-concave (its stage-1 cells overlap near 0 and leave long tails), so Lloyd's fixed point
        is not unique: from a uniform start it lands on fixed points up to 29% worse (d = 128, bits (2, 2)).
        Optimal 1-D quantizer cells are intervals, so dynamic programming over the bins finds the best partition of
        the grid exactly (as optimal 1-D k-means does: Wang & Song, Ckmeans.1d.dp, The R Journal 2011); Lloyd's
        iteration then only refines the edges within a bin.
        """
        edges = self.grid()
        w, m1, m2 = (np.concatenate([[0.0], np.cumsum(m)]) for m in self.pieces(edges, _GRID_NODES))
        # cost[a, b]: squared error of bins a..b-1 as one cell
        mass = w[None, :] - w[:, None]
        first = m1[None, :] - m1[:, None]
        cost = m2[None, :] - m2[:, None] - first**2 / np.where(mass > 0, mass, 1.0)
        cost = np.where(np.triu(np.ones_like(cost, bool), 1), np.maximum(cost, 0.0), np.inf)
        best, choices = cost[0], []
        for _ in range(levels - 1):
            total = best[:, None] + cost
            choices.append(np.argmin(total, axis=0))
            best = total[choices[-1], np.arange(total.shape[1])]
        cuts, stop = [], _GRID_BINS  # walk the choices back from the last bin
        for choice in reversed(choices):
            stop = int(choice[stop])
            cuts.append(stop)
        bounds = [0, *reversed(cuts), _GRID_BINS]
        return np.array([(m1[b] - m1[a]) / max(w[b] - w[a], 1e-300) for a, b in zip(bounds[:-1], bounds[1:])])


def _check(dim: int, bits: int, residual_bits: int) -> None:
    stage1._check(dim, bits)
    if not isinstance(residual_bits, int) or not 1 <= residual_bits <= 8:
        raise ValueError(f"residual_bits must be an int in 1..8; got {residual_bits!r}")


def residual_lloyd_max(dim: int, bits: int, residual_bits: int) -> tuple[np.ndarray, float]:
    """Solve the Lloyd-Max conditions for the stage-1 residual density ``g`` (no cache).

    The globally optimal partition of a fine grid (:meth:`_Residual.global_start`), then Lloyd's iteration on the
    exact density until no centroid moves by more than 1e-12 of the residual's standard deviation. ``g`` is even,
    but its optimal codebook need not be (at d = 128, (bits, residual_bits) = (1, 2) and (2, 2) are not; their
    mirror images are equally good); an even optimum is kept exactly even.

    :param dim: the padded head_dim, ``>= 2``. :param bits: stage-1 code width (its codebook from
        :func:`~kvq_backends_turboquant.codebook.load_or_compute`). :param residual_bits: stage-2 code width.
    :return: ``(centroids, mse)``: float64 ``[2**residual_bits]`` ascending residual centroids, and the total MSE
        of the two stages for a unit vector, ``dim · E[(x - c1[idx1] - c2[idx2])²]``.
    :raises ValueError: ``dim < 2``, or ``bits``/``residual_bits`` outside 1..8.
    """
    _check(dim, bits, residual_bits)
    density = _Residual(dim, bits)
    sigma = np.sqrt(density.variance)
    centroids = density.global_start(2**residual_bits)
    symmetric = np.allclose(centroids, -centroids[::-1], atol=1e-3 * sigma)
    previous = None
    for _ in range(_MAX_ITERATIONS):
        mass, moment, _ = density.cells(centroids)
        updated = np.where(mass > 0, moment / np.maximum(mass, 1e-300), centroids)
        if symmetric:  # keep an even codebook exactly even
            updated = (updated - updated[::-1]) / 2
        step, centroids = updated - centroids, updated
        if np.max(np.abs(step)) < _TOLERANCE * sigma:
            break
        previous, centroids = _extrapolate(centroids, step, previous)
    return centroids, density.mse(centroids)


def _extrapolate(centroids: np.ndarray, step: np.ndarray, previous: np.ndarray | None):
    """Aitken's Δ² along the steps: Lloyd's iteration converges linearly, and once two successive steps point the
    same way (cosine > 0.999) with ratio ``ρ < 0.999`` the remaining geometric series ``step · ρ/(1 - ρ)`` is added
    at once (2-4x fewer iterations; the stopping rule still checks a plain Lloyd step). Returns ``(step to remember,
    centroids)``."""
    if previous is None:
        return step, centroids
    norms = np.sqrt((step @ step) * (previous @ previous))
    ratio = np.sqrt((step @ step) / max(previous @ previous, 1e-300))
    if norms > 0 and step @ previous > 0.999 * norms and ratio < 0.999:
        return None, centroids + step * ratio / (1 - ratio)
    return step, centroids


def load_or_compute_residual(dim: int, bits: int, residual_bits: int, directory=None) -> tuple[np.ndarray, float]:
    """:func:`residual_lloyd_max` through the on-disk codebook cache (default directory
    :func:`~kvq_backends_turboquant.codebook.cache_dir`). :raises ValueError: as :func:`residual_lloyd_max`."""
    _check(dim, bits, residual_bits)
    header = {"version": FORMAT_VERSION, "dim": dim, "bits": bits, "residual_bits": residual_bits}
    notes = {"density": "x - c1[idx1(x)] for x ~ (1 - x^2)^((dim - 3) / 2) on [-1, 1], c1 Lloyd-Max at bits",
             "source": "residual VQ (Juang & Gray 1982) of TurboQuant's scalar quantizer, arXiv 2504.19874"}
    return stage1.cached(f"lloyd_max_residual_d{dim}_b{bits}_r{residual_bits}_v{FORMAT_VERSION}.json", header,
                         levels=2**residual_bits, compute=lambda: residual_lloyd_max(dim, bits, residual_bits),
                         notes=notes, directory=directory)


@lru_cache(maxsize=None)
def residual_codebook(dim: int, bits: int, residual_bits: int) -> Codebook:
    """The cached stage-2 :class:`~kvq_backends_turboquant.codebook.Codebook` (``bits`` = ``residual_bits``; its
    ``mse`` is the two-stage total ``D_mse`` of a unit vector). :raises ValueError: as :func:`residual_lloyd_max`."""
    centroids, mse = load_or_compute_residual(dim, bits, residual_bits)
    boundaries = (centroids[1:] + centroids[:-1]) / 2
    return Codebook(dim, residual_bits, mx.array(centroids.astype(np.float32)),
                    mx.array(boundaries.astype(np.float32)), mse)
