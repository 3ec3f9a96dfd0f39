"""kvq fused kernels for Metal (Apple GPUs) and CUDA (NVIDIA GPUs), built with MLX custom kernels.

Each kernel is written once in a small dialect (:mod:`kvq_metal.dialect`) and built for the back end of MLX's
default device. Implementations are registered for both back ends; each offers itself only on its own GPU, after
a first-use check against the pure-MLX implementation (:mod:`kvq_metal.base`), and kvq's selection ranks it by
cost against pure MLX.

Kernels: fused decode attention over compressed keys and values (:mod:`kvq_metal.attend`, on tensor cores on
CUDA in :mod:`kvq_metal.attend_tc`; ``affine``,
``turboquant``, ``turboquant_rvq``), fused TurboQuant encode/decode (normalise + randomized Hadamard + Lloyd-Max + pack;
:mod:`kvq_metal.quantize`).
"""

from __future__ import annotations

from . import attend, attend_tc, quantize
from .base import KernelDisabledWarning, KernelImpl
from .dialect import BACKENDS, gpu_backend, sources_hash

#: Kernel templates by name (hashed into benchmark results by :func:`kvq_metal.dialect.sources_hash`).
TEMPLATES = {
    "decode_attend": attend.SOURCE,
    "decode_attend_tc": attend_tc.HEADER + attend_tc.SOURCE,
    "tq_quantize": quantize.QUANTIZE_SOURCE,
    "tq_dequantize": quantize.DEQUANTIZE_SOURCE,
    "decode_merge": attend.MERGE_SOURCE,
}

#: Back ends a template is built for, where not both (the tensor-core kernel is written in CUDA: ``mma.sync``).
TEMPLATE_BACKENDS = {"decode_attend_tc": ("cuda",)}

__all__ = ["BACKENDS", "KernelDisabledWarning", "KernelImpl", "TEMPLATES", "TEMPLATE_BACKENDS", "gpu_backend",
           "implementations", "kvq_register", "sources_hash"]


def implementations() -> list:
    """Kernel implementation objects for every installed method kvq_metal serves, on both back ends (methods
    whose plugin is not installed are skipped)."""
    from .methods.affine import AffineKernels

    classes = [AffineKernels]
    try:
        import kvq_backends_turboquant  # noqa: F401
    except ImportError:
        pass
    else:
        from .methods.turboquant import TurboQuantKernels

        classes.append(TurboQuantKernels)
        if hasattr(kvq_backends_turboquant, "TurboQuantRVQParams"):
            from .methods.turboquant_rvq import TurboQuantRVQKernels

            classes.append(TurboQuantRVQKernels)
    return [cls(backend) for cls in classes for backend in BACKENDS]


def kvq_register(register):
    """Entry point ``metal``: kernel implementations (``metal`` and ``cuda`` back ends) of the installed methods."""
    for impl in implementations():
        register(impl)
