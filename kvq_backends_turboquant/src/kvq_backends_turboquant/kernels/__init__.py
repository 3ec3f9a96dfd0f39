"""TurboQuant's kernels, on kvq_metal: kernel files beside their launchers, and the implementation objects the
plugin registers (:func:`implementations`).

* :mod:`.quantize`: fused encode and decode (``tq_quantize.kvq``, ``tq_dequantize.kvq``; references
  :meth:`~kvq_backends_turboquant.impl.TurboQuantMLX.kvq_quantize` and ``kvq_dequantize``).
* :mod:`.turboquant`, :mod:`.turboquant_rvq`: ``turboquant`` (quantize, dequantize, attend) and ``turboquant_rvq``
  (attend); attention runs kvq_metal's generic decode-attention kernels (:func:`kvq_metal.attend.decode_attend`)
  over the codes described as :class:`kvq_metal.attend.Side`.
* :mod:`.turboquant_prod`: ``turboquant_prod`` (attend) on kvq_metal's streams kernel
  (:func:`kvq_metal.streams.decode_attend_streams`: the MSE stage and the residual's sign bits, two streams).
"""

from __future__ import annotations

from kvq_metal import BACKENDS

from .turboquant import TurboQuantKernels
from .turboquant_prod import TurboQuantProdKernels
from .turboquant_rvq import TurboQuantRVQKernels

__all__ = ["TurboQuantKernels", "TurboQuantProdKernels", "TurboQuantRVQKernels", "implementations"]


def implementations() -> list:
    """The kernel implementation objects of ``turboquant``, ``turboquant_prod`` and ``turboquant_rvq``, on both back
    ends (each offers itself only on its own GPU, after a first-use check against the pure-MLX implementation)."""
    return [cls(backend) for cls in (TurboQuantKernels, TurboQuantProdKernels, TurboQuantRVQKernels)
            for backend in BACKENDS]
