"""Route mlx-lm's attention to kvq for kvq caches (and keep ``max_kv_size`` meaningful): an idempotent, reversible
patch.

mlx-lm's model modules import ``scaled_dot_product_attention`` from ``mlx_lm.models.base`` by name. kvq replaces
that name in every loaded ``mlx_lm.models.*`` module with :func:`scaled_dot_product_attention`, which calls
:meth:`KVQCache.attend` of the kvq cache whose stand-ins it is given as keys and otherwise calls mlx-lm's original
function unchanged, so models with ordinary caches behave exactly as before.

This is the one place where mlx-lm's keyword ``sinks`` (learned attention-sink logits, gpt-oss) meets kvq, whose
``sinks`` are the first tokens kept uncompressed: the patched function accepts mlx-lm's keyword and passes it on
as ``sink_logits``.

mlx-lm's ``make_prompt_cache`` is replaced the same way (in ``mlx_lm.models.cache``, ``mlx_lm.generate``,
``mlx_lm.server`` ...) by :func:`make_prompt_cache`, so that ``max_kv_size`` is never silently dropped for a model
:func:`kvq.patch_model` patched.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models import base
from mlx_lm.models import cache as mlx_cache

from .reuse import exact_fetch, prefix_keeping_insert
from .views import CompressedView, is_kvq_cache

_ORIGINAL = base.scaled_dot_product_attention
_ORIGINAL_MAKE = mlx_cache.make_prompt_cache
#: mlx-lm's prompt-cache lookup (its server's LRU of finished requests' caches); None in an mlx-lm without it
_LRU = getattr(mlx_cache, "LRUPromptCache", None)
_ORIGINAL_LRU = (_LRU.fetch_nearest_cache, _LRU.insert_cache) if _LRU is not None else None
_EXACT_LRU = (exact_fetch(_ORIGINAL_LRU[0]), prefix_keeping_insert(_ORIGINAL_LRU[1])) if _LRU is not None else None
_PATCHED: set[str] = set()
_PATCHED_MAKE: set[str] = set()


def mlx_lm_caches(model) -> list:
    """The caches mlx-lm makes for ``model`` without kvq: the model's own ``make_cache()`` (the one from before
    :func:`kvq.patch_model`, if it patched the model), else a ``KVCache`` per layer."""
    patched = hasattr(model, "_kvq_original_make_cache")
    make_cache = model._kvq_original_make_cache if patched else getattr(model, "make_cache", None)
    return make_cache() if make_cache is not None else [mlx_cache.KVCache() for _ in model.layers]


def make_prompt_cache(model, max_kv_size=None):
    """mlx-lm's ``make_prompt_cache(model, max_kv_size)`` (same signature), which never ignores ``max_kv_size``.

    mlx-lm returns ``model.make_cache()`` whenever the model has one, ignoring ``max_kv_size``; a model patched by
    :func:`kvq.patch_model` has one, so without this a bounded request got kvq's unbounded caches (604 tokens held
    after a 600-token prompt with ``max_kv_size=64``). For such a model with ``max_kv_size`` this returns its kvq
    caches with every plain layer bounded: ``RotatingKVQCache(max_size=max_kv_size, keep=4)``, compressed, what
    mlx-lm gives a model without ``make_cache`` (:func:`kvq.make_prompt_cache`'s ``max_kv_size``). Everything else
    goes to mlx-lm's function unchanged.

    :raises ValueError: as :func:`kvq.make_prompt_cache` (``max_kv_size`` not an int above 4).
    """
    if max_kv_size is None or not hasattr(model, "_kvq_original_make_cache"):
        return _ORIGINAL_MAKE(model, max_kv_size)
    return model.make_cache(max_kv_size=max_kv_size)


def caller_max_kv_size() -> int | None:
    """The ``max_kv_size`` that mlx-lm's own ``make_prompt_cache`` was called with, when it is what called the
    function calling this (``model.make_cache()``, which mlx-lm calls without passing ``max_kv_size`` on); else
    ``None``. So a copy of mlx-lm's function bound before :func:`kvq.patch_model` (``from mlx_lm.models.cache import
    make_prompt_cache`` at the top of a script), which :func:`patch` cannot replace, still gets bounded caches."""
    frame = sys._getframe(2)  # [0] this function, [1] model.make_cache, [2] its caller
    if frame.f_code is not _ORIGINAL_MAKE.__code__:
        return None
    return frame.f_locals.get("max_kv_size")


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention entry point, with kvq caches served by kvq (same signature as mlx-lm's
    ``mlx_lm.models.base.scaled_dot_product_attention``).

    Attention follows the keys: stand-ins (:class:`~kvq.cache.CompressedView`) are attended by the kvq cache that
    made them, whichever cache the call names (a KV-sharing layer attends an earlier layer's keys with ``cache=None``
    or with its own cache); arrays, keys a kvq cache did not hand out, go to mlx-lm's function as they are, even
    when the call names a kvq cache. Only a call naming a kvq cache with neither (no stand-ins: a batch none of
    whose rows holds tokens yet) is that cache's.

    :param sinks: mlx-lm's name for learned attention-sink logits ``[H_q]`` (or ``None``); passed to
        :meth:`KVQCache.attend` as ``sink_logits``.
    """
    owner = keys.cache if isinstance(keys, CompressedView) else None
    kvq_cache = is_kvq_cache(cache)
    if owner is None and kvq_cache and not isinstance(keys, mx.array):
        owner = cache
    if owner is not None:
        return owner.attend(queries, scale, mask, sink_logits=sinks)
    return _ORIGINAL(queries, keys, values, cache=None if kvq_cache else cache, scale=scale, mask=mask, sinks=sinks)


def patch() -> list[str]:
    """Patch every loaded ``mlx_lm.models`` module that uses mlx-lm's attention; returns their names.

    Idempotent: a module already patched is left alone. Modules imported later are patched by the next call
    (``kvq.make_prompt_cache`` calls it every time). mlx-lm's server's prompt cache is patched too
    (``LRUPromptCache.fetch_nearest_cache`` and ``insert_cache``): it no longer reuses a kvq cache through a trim
    that would change what the request attends (:mod:`kvq.cache.reuse`).
    """
    if _LRU is not None:
        _LRU.fetch_nearest_cache, _LRU.insert_cache = _EXACT_LRU
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and name != "mlx_lm.models.base" and module is not None:
            if getattr(module, "scaled_dot_product_attention", None) is _ORIGINAL:
                module.scaled_dot_product_attention = scaled_dot_product_attention
                _PATCHED.add(name)
        # mlx-lm's make_prompt_cache, wherever a module bound it (models.cache, generate, server ...)
        if name.startswith("mlx_lm") and module is not None and getattr(module, "make_prompt_cache", None) is \
                _ORIGINAL_MAKE:
            module.make_prompt_cache = make_prompt_cache
            _PATCHED_MAKE.add(name)
    return sorted(_PATCHED)


def unpatch() -> None:
    """Restore mlx-lm's original functions everywhere kvq patched them."""
    if _LRU is not None and (_LRU.fetch_nearest_cache, _LRU.insert_cache) == _EXACT_LRU:
        _LRU.fetch_nearest_cache, _LRU.insert_cache = _ORIGINAL_LRU
    for name in list(_PATCHED_MAKE):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "make_prompt_cache", None) is make_prompt_cache:
            module.make_prompt_cache = _ORIGINAL_MAKE
        _PATCHED_MAKE.discard(name)
    for name in list(_PATCHED):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "scaled_dot_product_attention", None) is scaled_dot_product_attention:
            module.scaled_dot_product_attention = _ORIGINAL
        _PATCHED.discard(name)


def is_patched(module_name: str) -> bool:
    """Whether ``module_name``'s attention currently goes through kvq."""
    module = sys.modules.get(module_name)
    return getattr(module, "scaled_dot_product_attention", None) is scaled_dot_product_attention
