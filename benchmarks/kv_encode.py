"""Shared by the decode-attention benchmarks (``kernels.py``, ``profile_attend.py``): one method's implementations
and its keys and values encoded once by pure MLX (so the kernel and pure MLX read the same codes)."""

from __future__ import annotations

import kvq
import mlx.core as mx
from kvq.plugins import registry


def encode_kv(name: str, params: dict, keys: mx.array, values: mx.array, backend: str):
    """``(p, pure, kern, ke, ve)``: the parameters ``kvq.make_params(name, **params)``, the method's pure-MLX and
    ``backend`` implementations, and ``keys``/``values`` ``[B, H_kv, T, D]`` encoded by the pure-MLX one,
    evaluated.

    :raises ValueError: unknown method or parameters (from ``kvq.make_params``).
    :raises KeyError: no implementation of ``name`` for ``backend`` is installed.
    """
    p = kvq.make_params(name, **params)
    pure = registry().implementations[(name, "mlx")]
    kern = registry().implementations[(name, backend)]
    ke, ve = pure.kvq_quantize(keys, p), pure.kvq_quantize(values, p)
    mx.eval(ke.data, ve.data)
    return p, pure, kern, ke, ve
