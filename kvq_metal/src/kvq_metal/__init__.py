"""kvq's kernel library: fused kernels for Metal (Apple GPUs) and CUDA (NVIDIA GPUs), built with MLX custom kernels.

It knows no method (dependencies run one way: kvq core <- kvq_metal <- method plugins). It holds the dialect each
kernel is written in once and the launch helpers (:mod:`kvq_metal.dialect`), the kernel files and their loader
(:mod:`kvq_metal.kernel_files`), the base of kernel implementations and their first-use check
(:mod:`kvq_metal.base`, :mod:`kvq_metal.common`), and the generic kernels: fused decode attention over any code
stream that decodes as ``table[code] * scale + bias`` (:mod:`kvq_metal.attend`, on tensor cores on CUDA:
:mod:`kvq_metal.attend_tc`; pure-MLX reference :mod:`kvq_metal.reference`) and over code streams
(:mod:`kvq_metal.streams`, planned by :mod:`kvq_metal.streams_plan`, implementations' base
:mod:`kvq_metal.streams_impl`). Both families bind a cache's decode into one :class:`kvq_metal.step.DecodeStep`;
their launch knobs are frozen defaults (:mod:`kvq_metal.knobs`). A prefill chunk's attention over float16 or
bfloat16 keys and values, each query row seeing its own column intervals (no mask array), runs on CUDA tensor cores
in :mod:`kvq_metal.prefill` (issue #51; offered to kvq's cache as every kernel implementation's
``attend_columns``, off by its knob until measured on a GPU). Methods' plugins write their own
kernels on these pieces and register them themselves (``kvq_backends_turboquant.kernels``). Implementations
are registered for both back ends; each offers itself only on its own GPU, after a first-use check against the
pure-MLX implementation, and kvq's selection ranks it by cost against pure MLX.

The entry point ``metal`` registers the kernels of kvq core's baseline ``affine`` (:mod:`kvq_metal.baselines`:
the baseline lives in kvq core, below kvq_metal, so its kernels cannot live with it).
"""

from __future__ import annotations

from . import attend, attend_tc, prefill  # noqa: F401 - importing them loads (registers) kvq_metal's kernels
from .base import KernelDisabledWarning, KernelImpl
from .dialect import BACKENDS, gpu_backend
from .kernel_files import TEMPLATE_BACKENDS, TEMPLATES, sources_hash

__all__ = ["BACKENDS", "KernelDisabledWarning", "KernelImpl", "TEMPLATES", "TEMPLATE_BACKENDS", "gpu_backend",
           "implementations", "kvq_register", "sources_hash"]


def implementations() -> list:
    """kvq_metal's own kernel implementation objects, on both back ends: those of kvq core's baseline ``affine``
    (methods' plugins register theirs)."""
    from .baselines.affine import AffineKernels

    return [AffineKernels(backend) for backend in BACKENDS]


def kvq_register(register):
    """Entry point ``metal``: kernel implementations (``metal`` and ``cuda`` back ends) of kvq core's baselines."""
    for impl in implementations():
        register(impl)
