"""Route mlx-lm's attention to kvq for kvq caches: an idempotent, reversible patch.

mlx-lm's model modules import ``scaled_dot_product_attention`` from ``mlx_lm.models.base`` by name. kvq replaces
that name in every loaded ``mlx_lm.models.*`` module with :func:`scaled_dot_product_attention`, which calls
:meth:`KVQCache.attend` when the layer's cache is a kvq cache and otherwise calls mlx-lm's original function
unchanged, so models with ordinary caches behave exactly as before.

This is the one place where mlx-lm's keyword ``sinks`` (learned attention-sink logits, gpt-oss) meets kvq, whose
``sinks`` are the first tokens kept uncompressed: the patched function accepts mlx-lm's keyword and passes it on
as ``sink_logits``.
"""

from __future__ import annotations

import sys

from mlx_lm.models import base

from .batch import BatchKVQCache
from .layer import KVQCache

_ORIGINAL = base.scaled_dot_product_attention
_PATCHED: set[str] = set()


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention entry point, with kvq caches served by kvq (same signature as mlx-lm's
    ``mlx_lm.models.base.scaled_dot_product_attention``).

    :param sinks: mlx-lm's name for learned attention-sink logits ``[H_q]`` (or ``None``); passed to
        :meth:`KVQCache.attend` as ``sink_logits``.
    """
    if isinstance(cache, (KVQCache, BatchKVQCache)):
        return cache.attend(queries, scale, mask, sink_logits=sinks)
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def patch() -> list[str]:
    """Patch every loaded ``mlx_lm.models`` module that uses mlx-lm's attention; returns their names.

    Idempotent: a module already patched is left alone. Modules imported later are patched by the next call
    (``kvq.make_prompt_cache`` calls it every time).
    """
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and name != "mlx_lm.models.base" and module is not None:
            if getattr(module, "scaled_dot_product_attention", None) is _ORIGINAL:
                module.scaled_dot_product_attention = scaled_dot_product_attention
                _PATCHED.add(name)
    return sorted(_PATCHED)


def unpatch() -> None:
    """Restore mlx-lm's original function everywhere kvq patched it."""
    for name in list(_PATCHED):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "scaled_dot_product_attention", None) is scaled_dot_product_attention:
            module.scaled_dot_product_attention = _ORIGINAL
        _PATCHED.discard(name)


def is_patched(module_name: str) -> bool:
    """Whether ``module_name``'s attention currently goes through kvq."""
    module = sys.modules.get(module_name)
    return getattr(module, "scaled_dot_product_attention", None) is scaled_dot_product_attention
