"""The orthonormal Hadamard transform of the head dimension, and its inverse, via ``mx.hadamard_transform``.

VecInfer (Yao et al., arXiv 2510.06175, section 3) rotates keys (after smoothing) and values with a Hadamard matrix
``H`` (orthonormal: ``H Hᵀ = I``) so that outlier channels are spread over all coordinates before vector
quantization; the queries get the same ``H``, so ``(H q) · (H k) = q · k``.

``mx.hadamard_transform`` supports sizes ``m · 2^k`` with ``m`` in 1, 12, 20, 28; for other sizes it returns a
wrong result without an error (576 = 9 · 64, say), so sizes are checked here. The Sylvester matrices (``m = 1``)
are symmetric, hence their own inverse; some of the others are not (80 = 20 · 4), and their inverse is applied as
the dense transposed matrix.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

#: Odd factors ``m`` of the sizes ``m · 2^k`` that ``mx.hadamard_transform`` supports.
ODD_FACTORS = (1, 12, 20, 28)


def supported(dim: int) -> bool:
    """Whether ``dim`` is ``m · 2^k`` with ``m`` in :data:`ODD_FACTORS` (``k >= 0``)."""
    if not isinstance(dim, int) or dim < 1:
        return False
    power = 0
    while dim % 2 == 0:
        dim, power = dim // 2, power + 1
    return dim == 1 or (dim in (3, 5, 7) and power >= 2)  # 12, 20, 28 are 3, 5, 7 times 4


def _transform(x: mx.array) -> mx.array:
    return mx.hadamard_transform(x, scale=x.shape[-1] ** -0.5) if x.size else x


@lru_cache(maxsize=None)
def _inverse_matrix(dim: int) -> mx.array | None:
    """``H`` as dense float32 ``[dim, dim]`` when ``H`` is not symmetric (then ``y @ H = Hᵀ y``), else ``None``."""
    dense = np.array(_transform(mx.eye(dim, dtype=mx.float32)))  # row i is H e_i, i.e. column i of H
    matrix = dense.T
    return None if np.array_equal(matrix, matrix.T) else mx.array(matrix)


def forward(x: mx.array) -> mx.array:
    """``H x`` along the last axis: float32 ``[..., D]`` -> ``[..., D]``.

    :raises ValueError: ``D`` is not a size that ``mx.hadamard_transform`` supports.
    """
    check(x.shape[-1])
    return _transform(x)


def inverse(y: mx.array) -> mx.array:
    """``Hᵀ y`` along the last axis: float32 ``[..., D]`` -> ``[..., D]`` (the inverse of :func:`forward`).

    :raises ValueError: ``D`` is not a supported size.
    """
    check(y.shape[-1])
    matrix = _inverse_matrix(y.shape[-1])
    return _transform(y) if matrix is None else y @ matrix


def check(dim: int) -> None:
    """:raises ValueError: ``dim`` is not ``m · 2^k`` with ``m`` in 1, 12, 20, 28."""
    if not supported(dim):
        raise ValueError(f"vecinfer: head_dim {dim} is not supported: the Hadamard transform needs m * 2**k "
                         f"with m in {', '.join(map(str, ODD_FACTORS))} (e.g. 64, 80, 96, 128, 256)")
