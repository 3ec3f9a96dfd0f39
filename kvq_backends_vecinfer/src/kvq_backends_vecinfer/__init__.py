"""kvq plugin: VecInfer KV-cache compression (Yao et al., VecInfer, arXiv 2510.06175).

Method ``vecinfer``: keys are smoothed per channel and Hadamard-rotated (queries get the inverse smoothing and the
same rotation, so scores are unchanged), values are rotated only; then product vector quantization: each vector is
split into sub-vectors of ``sub_dim`` coordinates, each stored as the index of its nearest centroid in a k-means
codebook of ``2**code_bits`` entries. ``code_bits / sub_dim`` bits per coordinate, nothing else per token.

Codebooks and smoothing factors come from ``kvq calibrate --model M`` and are per layer, so the parameters carry
the model id and the layer (:meth:`VecInferParams.for_layer`, which ``kvq.make_prompt_cache`` calls per layer):
``kvq.make_prompt_cache(model, "vecinfer", model_id="M")``. kvq's commands that run a model (``kvq generate``,
``eval``, ``serve``, ``bench``) use ``--model``'s calibration, named as ``kvq calibrate`` names it
(:func:`.storage.model_id_for`). Without a model id the parameters are not ready (``check_ready``): a cache
refuses them and ``kvq.select`` says so in its plan. Modules: :mod:`.params`, :mod:`.impl` (quantize,
dequantize, attend by lookup tables), :mod:`.vq`, :mod:`.hadamard`, :mod:`.kmeans`, :mod:`.storage` (files),
:mod:`.collect` and :mod:`.calibrate` (calibration), :mod:`.kernels` (decode attention on the GPU).
"""

from __future__ import annotations

import kvq

from .impl import VecInferMLX
from .params import VecInferParams
from .storage import CalibrationError

SOURCE = "Yao et al., VecInfer, arXiv 2510.06175"

VECINFER = kvq.Method(
    "vecinfer", VecInferParams,
    "smoothing + Hadamard + product VQ with calibrated k-means codebooks, code_bits/sub_dim bits (e.g. 2, 1)",
    source=SOURCE, needs_calibration=True, calibrate="kvq_backends_vecinfer.calibrate")

__all__ = ["VECINFER", "CalibrationError", "VecInferMLX", "VecInferParams", "kvq_register"]


def kvq_register(register):
    """Entry point ``vecinfer``: the method, its pure-MLX implementation and its kernel implementations (``metal``
    and ``cuda``: :mod:`.kernels`, decode attention)."""
    from .kernels import implementations

    for obj in (VECINFER, VecInferMLX(), *implementations()):
        register(obj)
