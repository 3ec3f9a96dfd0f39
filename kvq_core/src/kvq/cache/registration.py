"""kvq's cache classes in mlx-lm's cache module, so that mlx-lm's own ``load_prompt_cache`` reads kvq's files.

mlx-lm's ``load_prompt_cache`` rebuilds each cache from the class name stored in the file, looked up in the globals
of ``mlx_lm.models.cache``; it knows kvq's classes only once they are set there. Importing kvq sets nothing: kvq's
entry points (:func:`kvq.make_prompt_cache`, :func:`kvq.patch_model`, :func:`kvq.save_prompt_cache`,
:func:`kvq.load_prompt_cache` and the ``kvq`` command) call :func:`register_with_mlx_lm`, and so can code that
only calls mlx-lm's loader.
"""

from __future__ import annotations

import mlx_lm.models.cache as mlx_cache

from .batch import BatchKVQCache
from .layer import KVQCache
from .rotating import RotatingKVQCache

#: the classes a kvq prompt-cache file names, by the name mlx-lm's loader looks up
CLASSES = {cls.__name__: cls for cls in (KVQCache, RotatingKVQCache, BatchKVQCache)}


def register_with_mlx_lm() -> None:
    """Set kvq's cache classes (:data:`CLASSES`: ``KVQCache``, ``RotatingKVQCache``, ``BatchKVQCache``) as
    attributes of ``mlx_lm.models.cache``, so that ``mlx_lm.models.cache.load_prompt_cache`` rebuilds the kvq caches
    of a prompt-cache file (and their ``from_state`` routes mlx-lm's attention to kvq: :mod:`kvq.cache.patch`).

    Idempotent; changes nothing else of mlx-lm and raises nothing (mlx-lm is imported with :mod:`kvq.cache`).
    """
    for name, cls in CLASSES.items():
        setattr(mlx_cache, name, cls)
