"""RoPE settings given only in transformers' newer ``rope_parameters`` layout, read where mlx-lm does not.

transformers (4.56 and later) writes a model's RoPE as ``"rope_parameters": {"rope_theta": ..., "rope_type": ...}``
or, per layer type, ``{"full_attention": {...}, "sliding_attention": {...}}``, and may leave out the top-level
``rope_theta``. Most of mlx-lm's model classes read only ``rope_theta`` (and ``rope_scaling``, and gemma's
``rope_local_base_freq``), so such a config loads with their default base, 10000 for llama, whatever it says, and
nothing warns (on a test model: a max logit difference of 7.1). :func:`rope_overrides` gives the keys to pass to
mlx-lm instead (``mlx_lm.load(..., model_config=...)``), read as transformers reads them.
"""

from __future__ import annotations

import dataclasses


def _reads_rope_parameters(config: dict) -> bool:
    """Whether mlx-lm's model class for ``config`` reads ``rope_parameters`` itself (its ModelArgs has the field);
    ``False`` where mlx-lm has no class for it (its loader then fails on its own)."""
    try:
        from mlx_lm.utils import _get_classes

        _, args_class = _get_classes(config)
    except (ImportError, ValueError, KeyError, AttributeError):
        return False
    return dataclasses.is_dataclass(args_class) and "rope_parameters" in {f.name for f in dataclasses.fields(args_class)}


def rope_overrides(config: dict) -> dict:
    """The config keys kvq passes to mlx-lm for a model whose RoPE is given only in ``rope_parameters``: ``{}`` where
    the config has a top-level ``rope_theta``, has no ``rope_parameters``, or mlx-lm's class reads
    ``rope_parameters`` itself.

    From the flat form, or from ``full_attention`` in the per-layer-type form: ``rope_theta`` (float) and, for a
    ``rope_type`` other than ``"default"``, ``rope_scaling`` (the entries but ``rope_theta``, as mlx-lm reads
    ``rope_scaling``) unless the config has one; from ``sliding_attention``: ``rope_local_base_freq`` (gemma's name
    for the sliding layers' base) unless the config has one.

    :param config: a model's ``config.json`` as a dict.
    :raises ValueError: ``rope_parameters`` that is not a dict, or whose ``rope_theta`` is not a number.
    """
    params = config.get("rope_parameters")
    if params is None or "rope_theta" in config:
        return {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json: rope_parameters must be a dict; got {type(params).__name__}")
    if _reads_rope_parameters(config):
        return {}
    full = params if "rope_theta" in params or "rope_type" in params else params.get("full_attention") or {}
    out = {}
    if "rope_theta" in full:
        theta = full["rope_theta"]
        if isinstance(theta, bool) or not isinstance(theta, (int, float)):
            raise ValueError(f"config.json: rope_parameters' rope_theta must be a number; got {theta!r}")
        out["rope_theta"] = float(theta)
    if full.get("rope_type", "default") != "default" and "rope_scaling" not in config:
        out["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    sliding = params.get("sliding_attention")
    if isinstance(sliding, dict) and "rope_theta" in sliding and "rope_local_base_freq" not in config:
        out["rope_local_base_freq"] = float(sliding["rope_theta"])
    return out
