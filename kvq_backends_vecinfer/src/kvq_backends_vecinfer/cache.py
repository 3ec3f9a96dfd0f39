"""Per-layer ``vecinfer`` caches for mlx-lm, until :func:`kvq.make_prompt_cache` binds parameters to layers itself.

Codebooks are per layer, and kvq's cache takes one parameter object for all layers. :func:`make_prompt_cache`
builds kvq's caches and gives layer ``i`` the parameters ``params.for_layer(i)``; it also sets ``role="values"``
on the values' side unless given.
"""

from __future__ import annotations

from typing import Any

import attrs


def bind_layers(caches: list) -> list:
    """Give every kvq cache in ``caches`` (one per ``model.layers`` entry) parameters bound to its index.

    Parameters without ``for_layer`` (other methods) and caches that are not kvq's are left alone. Returns a new
    list; bound caches are fresh (empty).
    """
    from kvq.cache import KVQCache

    out = []
    for i, cache in enumerate(caches):
        if isinstance(cache, KVQCache):
            config = cache.config
            config = attrs.evolve(config, key_params=_bound(config.key_params, i),
                                  value_params=_bound(config.value_params, i))
            cache = KVQCache(config)
        out.append(cache)
    return out


def _bound(params, layer: int):
    return params.for_layer(layer) if hasattr(params, "for_layer") else params


def make_prompt_cache(model, model_id: str, *, key_params: dict | None = None, value_params: dict | None = None,
                      **kwargs: Any) -> list:
    """:func:`kvq.make_prompt_cache` for ``vecinfer`` keys and values with per-layer codebooks.

    :param model: an mlx-lm model. :param model_id: the calibrated model's id (``kvq calibrate --model``).
    :param key_params: vecinfer parameters of the keys (e.g. ``dict(sub_dim=4, code_bits=8)``).
    :param value_params: of the values (``role="values"`` is added unless given).
    :param kwargs: passed on (``sinks=``, ``window=``, ``step=``); ``key_method``/``value_method`` put another
        method on one side (its parameters in ``key_params``/``value_params``).
    :raises ValueError: as :func:`kvq.make_prompt_cache`; a missing calibration names the command to run.
    """
    import kvq

    key_method = kwargs.pop("key_method", "vecinfer")
    value_method = kwargs.pop("value_method", "vecinfer")
    keys, values = dict(key_params or {}), dict(value_params or {})
    if key_method == "vecinfer":
        keys = {"model_id": model_id, **keys}
    if value_method == "vecinfer":
        values = {"model_id": model_id, "role": "values", **values}
    caches = kvq.make_prompt_cache(model, "vecinfer", key_method=key_method, value_method=value_method,
                                   key_params=keys, value_params=values, **kwargs)
    return bind_layers(caches)
