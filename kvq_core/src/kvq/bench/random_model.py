"""Random-weight llama models of real shapes, for benchmarks where only the cost of attention matters.

``kvq bench e2e --model random:llama3-8b`` decodes with a model of Llama-3.1-8B's shape (32 layers, hidden 4096,
32 query heads, 8 KV heads, head_dim 128, intermediate 14336, vocab 128256, RoPE theta 500000 with the llama3
scaling, 131072 positions) whose weights are random: the time per token and the memory are those of the real
model, and no weights need to be downloaded. The shapes are those of Meta's published configs
(``meta-llama/Llama-3.1-8B``, ``Llama-3.2-3B``, ``Llama-3.2-1B``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

#: How a random model is named on the command line: ``random:<preset>``.
PREFIX = "random:"

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_LLAMA3 = dict(model_type="llama", rms_norm_eps=1e-5, vocab_size=128256, rope_theta=500000.0,
               rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072, num_key_value_heads=8)

#: mlx-lm ``llama.ModelArgs`` fields per preset.
PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(_LLAMA3, hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                      num_attention_heads=32, head_dim=128, tie_word_embeddings=False),
    "llama3-3b": dict(_LLAMA3, hidden_size=3072, num_hidden_layers=28, intermediate_size=8192,
                      num_attention_heads=24, head_dim=128, tie_word_embeddings=True),
    "llama3-1b": dict(_LLAMA3, hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                      num_attention_heads=32, head_dim=64, tie_word_embeddings=True),
    # for tests: two layers, GQA 2:1, head_dim 64 (the smallest every kvq method accepts)
    "tiny": dict(model_type="llama", rms_norm_eps=1e-5, vocab_size=512, rope_theta=500000.0,
                 max_position_embeddings=131072, hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
}


def is_random(name: str | None) -> bool:
    """Whether a ``--model`` value names a random model (``random:<preset>``)."""
    return bool(name) and name.startswith(PREFIX)


def random_config(name: str, layers: int | None = None) -> dict[str, Any]:
    """The ``llama.ModelArgs`` fields of ``random:<preset>``, with the layer count cut to ``layers`` if given.

    :param name: ``"random:llama3-8b"`` or a bare preset name (``"tiny"``).
    :param layers: keep this many decoder layers (``1 <= layers <=`` the preset's count); ``None``: all.
    :return: a new dict (callers may change it).
    :raises ValueError: an unknown preset (the presets are listed) or ``layers`` out of range.
    """
    preset = name.removeprefix(PREFIX)
    if preset not in PRESETS:
        raise ValueError(f"--model {name!r}: unknown random preset {preset!r}; choose one of "
                         f"{', '.join(PREFIX + p for p in PRESETS)}")
    config = dict(PRESETS[preset])
    if layers is not None:
        if not 1 <= layers <= config["num_hidden_layers"]:
            raise ValueError(f"--layers must be in 1..{config['num_hidden_layers']} for {PREFIX}{preset}; "
                             f"got {layers}")
        config["num_hidden_layers"] = layers
    return config


def build_random_model(config: dict[str, Any], dtype: mx.Dtype = mx.bfloat16, seed: int = 0):
    """An ``mlx_lm.models.llama.Model`` with random weights (mlx.nn's default initialisers) in ``dtype``.

    Weights are created and cast one layer at a time, so the float32 initial values of a whole 8B model
    (32 GB) never exist at once; the model holds only ``dtype`` weights (16 GB for llama3-8b in bfloat16).

    :param config: ``llama.ModelArgs`` fields (:func:`random_config`).
    :param dtype: a floating dtype (``mx.bfloat16``, ``mx.float16`` or ``mx.float32``).
    :param seed: MLX random seed, so two builds are identical.
    :return: the model, evaluated.
    """
    from mlx_lm.models import llama

    from ..install_hints import note_blas_before_model_work

    note_blas_before_model_work()
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))  # lazy: nothing is computed yet
    model.set_dtype(dtype)
    for module in [model.model.embed_tokens, *model.layers, model.model.norm, getattr(model, "lm_head", None)]:
        if module is not None:
            mx.eval(module.parameters())
    return model
