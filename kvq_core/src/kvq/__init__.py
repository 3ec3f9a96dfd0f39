"""kvq: KV-cache compression for LLMs run with MLX (mlx-lm), as a plugin framework.

Public entry points: :func:`select` (the implementation per op for a shape), :func:`register` (add a method or
implementation that is not installed as an entry point), :func:`methods`, :func:`make_params`, and the cache
(:func:`make_prompt_cache`, prompt-cache files: :func:`save_prompt_cache`, :func:`load_prompt_cache`). What a plugin
provides is specified in :mod:`kvq.contract` (its Protocols :class:`Implementation` and :class:`Params` are also
exported here); :func:`plugin_manager` is the pluggy manager that validated it. docs/DESIGN.md, "Vocabulary", gives
the names used throughout.

``import kvq`` does not import mlx-lm (seconds: it imports transformers). The cache API, :mod:`kvq.cache`,
:mod:`kvq.models` and :mod:`kvq.distributed` are attributes loaded on first use; and once anything imports mlx-lm's
cache module, kvq's cache classes are added to it, so that ``mlx_lm.models.cache.load_prompt_cache`` reads kvq's
prompt-cache files after a bare ``import kvq``.
"""

import importlib
import importlib.abc
import sys
import warnings

from . import contract
from .contract import Implementation, Params
from .encoded import Encoded
from .hookspecs import OPS, hookimpl
from .methods import BitsAccounting, Method
from .problem import Problem
from .plugins import (PluginLoadWarning, RegistrationError, all_implementations, make_params, methods,
                       plugin_manager, register, registry, unregister)
from .select import Plan, select

__version__ = "0.1.0"

_CACHE_API = ("make_prompt_cache", "patch_model", "unpatch_model", "load_prompt_cache", "save_prompt_cache",
              "KVQCache", "RotatingKVQCache")


def __getattr__(name):
    # the cache imports mlx-lm (and transformers): load it on first use, not with ``import kvq``
    # (import_module, not ``from . import``: that asks this function for the name first)
    if name == "cache" or name in _CACHE_API:
        cache = importlib.import_module("kvq.cache")
        return cache if name == "cache" else getattr(cache, name)
    if name == "models":
        return importlib.import_module("kvq.models")
    if name == "distributed":
        return importlib.import_module("kvq.distributed")
    raise AttributeError(f"module 'kvq' has no attribute {name!r}")


_MLX_LM_CACHE = "mlx_lm.models.cache"


def _add_caches_to_mlx_lm() -> None:
    """Import :mod:`kvq.cache`, which adds kvq's cache classes to mlx-lm's cache module (its
    ``load_prompt_cache`` finds classes by name there); a failure is a warning, not a failed mlx-lm import."""
    if "kvq.cache" in sys.modules:
        return  # imported, or being imported: it adds them as its import runs
    try:
        importlib.import_module("kvq.cache")
    except Exception as exc:  # noqa: BLE001 - mlx-lm must still import
        warnings.warn(f"kvq could not add its caches to mlx-lm ({exc!r}); mlx-lm's load_prompt_cache will not "
                      f"read kvq's prompt-cache files until `import kvq.cache` works", stacklevel=2)


class _AfterMlxLmCache(importlib.abc.MetaPathFinder):
    """Runs :func:`_add_caches_to_mlx_lm` right after mlx-lm's cache module first runs, whoever imports it; other
    finders find and load the module as they would without this one."""

    def find_spec(self, name, path, target=None):
        if name != _MLX_LM_CACHE:
            return None
        others = (f for f in sys.meta_path if f is not self and hasattr(f, "find_spec"))
        spec = next((s for f in others if (s := f.find_spec(name, path, target)) is not None), None)
        if spec is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenAddCaches(spec.loader, self)
        return spec


class _ThenAddCaches(importlib.abc.Loader):
    """The module's own loader, then :func:`_add_caches_to_mlx_lm` (once: the finder then steps aside)."""

    def __init__(self, loader, finder) -> None:
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self.loader
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        _add_caches_to_mlx_lm()

    def __getattr__(self, name):  # get_source, get_filename ...: the module's own loader's
        if name in ("loader", "finder"):  # not set yet (a copy): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


if _MLX_LM_CACHE in sys.modules:
    _add_caches_to_mlx_lm()
else:
    sys.meta_path.insert(0, _AfterMlxLmCache())

__all__ = [
    "OPS", "BitsAccounting", "Encoded", "Implementation", "Method", "Params", "Plan", "PluginLoadWarning",
    "Problem", "RegistrationError", "all_implementations", "contract", "hookimpl", "make_params", "methods",
    "plugin_manager", "register", "registry", "select", "unregister", "__version__", *_CACHE_API,
]
