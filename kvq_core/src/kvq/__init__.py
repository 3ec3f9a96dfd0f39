"""kvq: KV-cache compression for LLMs run with MLX (mlx-lm), as a plugin framework.

Public entry points: :func:`select` (the implementation per op for a shape), :func:`register` (add a method or
implementation that is not installed as an entry point), :func:`methods`, :func:`make_params`, and the cache
(:func:`make_prompt_cache`, prompt-cache files: :func:`save_prompt_cache`, :func:`load_prompt_cache`). What a plugin
provides is specified in :mod:`kvq.contract` (its Protocols :class:`Implementation` and :class:`Params` are also
exported here); :func:`plugin_manager` is the pluggy manager that validated it. docs/DESIGN.md, "Vocabulary", gives
the names used throughout.

``import kvq`` does not import mlx-lm (seconds: it imports transformers), patches nothing and installs no import
hook. The cache API, :mod:`kvq.cache`, :mod:`kvq.models`, :mod:`kvq.distributed` and :mod:`kvq.defaults` (the
recommended setting, the flush) are attributes loaded on first use. mlx-lm's own ``load_prompt_cache`` reads kvq's prompt-cache files once :func:`register_with_mlx_lm` has run:
kvq's cache functions call it; code that only calls mlx-lm's loader calls it first.
"""

import importlib

try:  # every module below needs MLX: where its back-end library is missing, say how to install it
    import mlx.core  # noqa: F401
except ImportError as _exc:
    if "libmlx" not in str(_exc):
        raise
    from .install_hints import missing_backend_text

    # (from None: the message holds MLX's own; the kvq command printed both tracebacks, 14 lines, before it)
    raise ImportError(missing_backend_text(_exc)) from None

from . import contract
from .contract import Implementation, Params
from .encoded import Encoded
from .hookspecs import OPS, hookimpl
from .declaration import BitsAccounting, Method
from .problem import Problem
from .plugins import (PluginLoadWarning, RegistrationError, all_implementations, make_params, methods,
                       plugin_manager, register, registry, unregister)
from .selection import Plan, select

__version__ = "0.2.0"

_CACHE_API = ("make_prompt_cache", "patch_model", "unpatch_model", "load_prompt_cache", "save_prompt_cache",
              "prefill_prompt", "register_with_mlx_lm", "KVQCache", "RotatingKVQCache")


def __getattr__(name):
    # the cache imports mlx-lm (and transformers): load it on first use, not with ``import kvq``
    # (import_module, not ``from . import``: that asks this function for the name first)
    if name == "cache" or name in _CACHE_API:
        cache = importlib.import_module("kvq.cache")
        return cache if name == "cache" else getattr(cache, name)
    if name == "models":
        return importlib.import_module("kvq.models")
    if name in ("distributed", "defaults"):
        return importlib.import_module(f"kvq.{name}")
    raise AttributeError(f"module 'kvq' has no attribute {name!r}")


def __dir__():
    # the module's own names plus those __getattr__ loads on first use (dir() sees neither until then)
    return sorted({*(n for n in globals() if n != "importlib"), *__all__, "cache", "models", "distributed",
                   "defaults"})


__all__ = [
    "OPS", "BitsAccounting", "Encoded", "Implementation", "Method", "Params", "Plan", "PluginLoadWarning",
    "Problem", "RegistrationError", "all_implementations", "contract", "hookimpl", "make_params", "methods",
    "plugin_manager", "register", "registry", "select", "unregister", "__version__", *_CACHE_API,
]
