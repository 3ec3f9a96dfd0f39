"""Lloyd-Max codebooks for one coordinate of a uniformly random unit vector (TurboQuant's scalar quantizer).

A coordinate ``x`` of a unit vector drawn uniformly from the sphere in ``R^d`` has the density
``f(x) ∝ (1 - x²)^((d - 3) / 2)`` on ``[-1, 1]`` (a scaled Beta; ``→ N(0, 1/d)`` as ``d`` grows). TurboQuant
(Zandieh et al., arXiv 2504.19874, section 3.1) quantizes every rotated coordinate with the Lloyd-Max (MSE-optimal
scalar) quantizer of that exact density. We compute it with numpy only: substituting ``x = sin θ`` turns the
density into ``cos^(d-2) θ`` on ``[-π/2, π/2]`` (smooth for every ``d >= 2``), and each cell's mass and first moment
are integrated by Gauss-Legendre quadrature in ``θ``, to machine precision.

Codebooks are cached in memory and on disk as JSON under ``codebooks/`` in kvq's cache folder
(:func:`kvq.paths.cache_root`: ``$KVQ_CACHE_DIR`` when set, ``~`` expanded, else
``platformdirs.user_cache_dir("kvq")``); a corrupt or foreign file is recomputed.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import attrs
import mlx.core as mx
import numpy as np
from kvq import packing
from kvq.paths import cache_root

#: Bump when the numerics change, so stale files on disk are ignored.
FORMAT_VERSION = 1
_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(200)
_TOLERANCE = 1e-12  # in units of the coordinate's standard deviation 1/sqrt(dim)
_MAX_ITERATIONS = 20000


def cache_dir() -> Path:
    """Directory of the on-disk codebook cache: ``codebooks/`` under kvq's cache folder
    (:func:`kvq.paths.cache_root`: ``$KVQ_CACHE_DIR`` with ``~`` expanded, else the platformdirs user cache), where
    kvq keeps its converted models, autotune tables and kernel texts too."""
    return cache_root() / "codebooks"


def _check(dim: int, bits: int) -> None:
    if not isinstance(dim, int) or dim < 2:
        raise ValueError(f"dim must be an int >= 2 (the rotated, padded head_dim); got {dim!r}")
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8; got {bits!r}")


def _cells(centroids: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Probability mass and first moment of each Voronoi cell of ``centroids`` (mass normalised to 1).

    Each cell ``[a, b]`` is integrated in ``θ = arcsin x`` (integrand ``cos^(dim-2) θ`` and ``sin θ cos^(dim-2) θ``,
    smooth for every ``dim >= 2``) by Gauss-Legendre quadrature, to machine precision.
    """
    edges = np.arcsin(np.clip(np.concatenate([[-1.0], (centroids[1:] + centroids[:-1]) / 2, [1.0]]), -1, 1))
    lo, hi = edges[:-1, None], edges[1:, None]
    theta = (hi - lo) / 2 * _NODES + (hi + lo) / 2
    weight = (hi - lo) / 2 * _WEIGHTS * np.exp((dim - 2) * np.log(np.cos(theta)))
    mass, moment = weight.sum(axis=1), (weight * np.sin(theta)).sum(axis=1)
    return mass / mass.sum(), moment / mass.sum()


def lloyd_max(dim: int, bits: int) -> tuple[np.ndarray, float]:
    """Solve the Lloyd-Max conditions for ``f(x) ∝ (1 - x²)^((dim - 3)/2)`` (no cache).

    Lloyd's iteration (centroid = conditional mean of its cell; cell edges = midpoints) from a uniform spread over
    ±3 standard deviations, until no centroid moves by more than 1e-12 of the standard deviation ``1/sqrt(dim)``.

    :param dim: dimension of the sphere's ambient space (the padded head_dim), ``>= 2``.
    :param bits: code width; the codebook has ``2**bits`` levels.
    :return: ``(centroids, mse)``: float64 ``[2**bits]`` ascending centroids (symmetric about 0), and the
        total MSE of a unit vector, ``dim * E[(x - q(x))²]`` (TurboQuant's ``D_mse``).
    :raises ValueError: ``dim < 2`` or ``bits`` outside 1..8.
    """
    _check(dim, bits)
    levels = 2**bits
    spread = min(1.0, 3.0 / np.sqrt(dim))  # the density's bulk: ±3 standard deviations, within [-1, 1]
    centroids = np.linspace(-spread, spread, 2 * levels + 1)[1::2]
    for _ in range(_MAX_ITERATIONS):
        mass, moment = _cells(centroids, dim)
        updated = np.where(mass > 0, moment / np.maximum(mass, 1e-300), centroids)
        updated = (updated - updated[::-1]) / 2  # the density is even: keep the codebook exactly symmetric
        done = np.max(np.abs(updated - centroids)) * np.sqrt(dim) < _TOLERANCE
        centroids = updated
        if done:
            break
    mass, _ = _cells(centroids, dim)
    # at the fixed point E[x q(x)] = E[q(x)²], so E[(x - q)²] = E[x²] - Σ P_i c_i², with E[x²] = 1/dim
    mse = 1.0 - dim * float(np.sum(mass * centroids**2))
    return centroids, mse


def _load(path: Path, header: dict, levels: int):
    """``(centroids, mse)`` from a cache file whose header matches and whose table is sane, else ``None``."""
    try:
        record = json.loads(path.read_text())
        centroids = np.asarray(record["centroids"], dtype=np.float64)
        ok = (all(record.get(k) == v for k, v in header.items()) and centroids.shape == (levels,)
              and np.all(np.isfinite(centroids)) and np.all(np.diff(centroids) > 0))
        return (centroids, float(record["mse"])) if ok else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cached(name: str, header: dict, levels: int, compute, notes: dict, directory: Path | None = None):
    """``compute() -> (centroids, mse)`` through the JSON file ``name`` in ``directory`` (default :func:`cache_dir`).

    A file is used only if every ``header`` item (which must include ``"version": FORMAT_VERSION``) matches and it
    holds ``levels`` finite ascending centroids; otherwise it is recomputed. The file is written atomically
    (temporary file, then rename), so concurrent processes never read half a file; a directory that cannot be
    written only costs the recomputation next time. ``notes`` are written along (density, source).
    """
    directory = cache_dir() if directory is None else Path(directory)
    path = directory / name
    found = _load(path, header, levels)
    if found is not None:
        return found
    centroids, mse = compute()
    record = {**header, **notes, "mse": mse, "centroids": centroids.tolist()}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        pass
    return centroids, mse


def load_or_compute(dim: int, bits: int, directory: Path | None = None) -> tuple[np.ndarray, float]:
    """:func:`lloyd_max` through the on-disk cache in ``directory`` (default :func:`cache_dir`; see :func:`cached`).

    :raises ValueError: ``dim < 2`` or ``bits`` outside 1..8.
    """
    _check(dim, bits)
    header = {"version": FORMAT_VERSION, "dim": dim, "bits": bits}
    notes = {"density": "(1 - x^2)^((dim - 3) / 2) on [-1, 1]", "source": "TurboQuant, arXiv 2504.19874"}
    return cached(f"lloyd_max_d{dim}_b{bits}_v{FORMAT_VERSION}.json", header, 2**bits,
                  lambda: lloyd_max(dim, bits), notes, directory)


@attrs.frozen(eq=False)
class Codebook:
    """A Lloyd-Max codebook as MLX arrays, ready to encode and decode rotated unit-vector coordinates.

    :param dim: padded head_dim the density is for. :param bits: code width.
    :param centroids: float32 ``[2**bits]``, ascending. :param boundaries: float32 ``[2**bits - 1]``, the cell
        edges (midpoints of neighbouring centroids). :param mse: ``D_mse`` of a unit vector (float).
    """

    dim: int
    bits: int
    centroids: mx.array
    boundaries: mx.array
    mse: float
    #: the CPU's :class:`kvq.packing.Lookup` of the centroids, made on first use (:meth:`decode_packed`)
    _lookups: dict = attrs.field(factory=dict, init=False, repr=False)

    def encode(self, y: mx.array) -> mx.array:
        """Nearest-centroid codes of ``y`` (float32, any shape): uint32 of the same shape, below ``2**bits``.

        The code is the number of cell boundaries below ``y`` (one broadcast comparison: a temporary of
        ``2**bits - 1`` bytes per coordinate, several times faster on CPU than a binary search by gathers).
        """
        return mx.sum(y[..., None] > self.boundaries, axis=-1).astype(mx.uint32)

    def decode(self, codes: mx.array) -> mx.array:
        """Centroid values of ``codes`` (uint32, any shape): float32 of the same shape."""
        return mx.take(self.centroids, codes)

    def decode_packed(self, packed: mx.array, count: int) -> mx.array:
        """Centroid values of the first ``count`` codes packed in ``packed`` (uint32 ``[..., W]``,
        :func:`kvq.packing.pack`'s layout at ``bits``): float32 ``[..., count]``, bit for bit
        ``decode(unpack(packed, bits, count))``. On the CPU several codes are looked up per gather
        (:class:`kvq.packing.Lookup`: 2.6x faster at 4 bits, 8x at 3, where MLX's CPU gather is slow); elsewhere the
        codes are unpacked and gathered.

        :raises ValueError: as :func:`kvq.packing.unpack`."""
        if mx.default_device() != mx.cpu:
            return self.decode(packing.unpack(packed, self.bits, count))
        lookup = self._lookups.get("cpu")
        if lookup is None:
            lookup = self._lookups["cpu"] = packing.Lookup(np.asarray(self.centroids), self.bits)
        return lookup(packed, count)

    @property
    def nbytes(self) -> int:
        """Bytes of the resident tables (a shared constant, not per token)."""
        return self.centroids.nbytes + self.boundaries.nbytes


@lru_cache(maxsize=None)
def codebook(dim: int, bits: int) -> Codebook:
    """The cached :class:`Codebook` for padded head_dim ``dim`` and ``bits`` (computed once per process and disk).

    :raises ValueError: ``dim < 2`` or ``bits`` outside 1..8.
    """
    centroids, mse = load_or_compute(dim, bits)
    boundaries = (centroids[1:] + centroids[:-1]) / 2
    return Codebook(dim, bits, mx.array(centroids.astype(np.float32)), mx.array(boundaries.astype(np.float32)), mse)
