"""Whether kvq can serve a model's attention: found once per model class by building (not running) a forward pass.

kvq's caches hand the model stand-ins for keys and values (:class:`kvq.cache.CompressedView`) and compute
attention themselves when the model calls mlx-lm's shared ``scaled_dot_product_attention``. A model whose
attention does anything else with the keys and values first (stablelm casts them, plamo tiles them, gemma2 and
deepseek_v3 compute attention themselves) cannot use them: with kvq's caches it crashes at its first forward pass
(issue #25). :func:`unservable_reason` finds that out before any cache is handed over: it builds a two-token
forward pass with throwaway caches, lazily (MLX computes nothing; only the Python of the model runs), with kvq's
caches and, if that raises, with mlx-lm's own. Only a model that works with mlx-lm's caches and not with kvq's
is unservable; the verdict is kept per model class and cache settings (a setting that fails at the first
compression must not mark the model unservable for every other setting). :func:`kvq.make_prompt_cache` then keeps
mlx-lm's caches for that model and warns, naming the error.
"""

from __future__ import annotations

from typing import Callable, Hashable

import mlx.core as mx

#: (model class, settings) -> ``None`` (kvq serves it) or the error its forward pass raised with kvq's caches.
_VERDICTS: dict[tuple, str | None] = {}


class UnservableModelWarning(UserWarning):
    """kvq cannot serve this model's attention; it keeps mlx-lm's caches (see :mod:`kvq.cache.servable`)."""


def _builds(model, caches: list) -> str | None:
    """``None`` if a lazy two-token forward pass with ``caches`` builds, else ``"Type: message"``."""
    try:
        model(mx.array([[1, 2]]), cache=caches)
    except Exception as exc:  # noqa: BLE001 - any error is the verdict, reported by name
        return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    return None


def unservable_reason(model, kvq_caches: Callable[[], list], mlx_caches: Callable[[], list],
                      settings: Hashable = None) -> str | None:
    """Why kvq cannot serve ``model`` (the error its forward pass raises with kvq's caches where mlx-lm's work), or
    ``None`` when it can, or when the probe says nothing (it fails with mlx-lm's caches too: a model that needs
    other inputs). Found once per model class and ``settings`` (what ``kvq_caches`` makes depends on: e.g. the
    cache configuration and ``max_kv_size``; unhashable settings are probed at every call); ``kvq_caches`` and
    ``mlx_caches`` make fresh throwaway caches. Nothing is evaluated: the probe costs the Python of one forward
    pass."""
    key = (type(model), settings)
    try:
        known = key in _VERDICTS
    except TypeError:  # settings that cannot be hashed (arrays in a method's parameters): not kept
        key, known = None, False
    if known:
        return _VERDICTS[key]
    failure = _builds(model, kvq_caches())
    if failure is not None and _builds(model, mlx_caches()) is not None:
        failure = None  # not kvq's doing: the probe cannot tell
    if key is not None:
        _VERDICTS[key] = failure
    return failure
