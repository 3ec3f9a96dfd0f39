"""Prompt-cache files: mlx-lm's format, with checksums that kvq writes and both loaders verify.

mlx-lm's format (``mlx_lm.models.cache.save_prompt_cache``, mlx-lm 0.32) is one safetensors file: every cache's
``state`` flattened (``"0.keys.codes"``), with ints, strings and ``None`` stored as arrays; its metadata holds the
caller's metadata, the cache class names and which entries were not arrays. :func:`save_prompt_cache` writes that
format with two additions that mlx-lm's loader carries along unread:

- each kvq layer's state holds a checksum of itself (:data:`~kvq.cache.state.LAYER_CHECKSUM`), which
  ``KVQCache.from_state`` verifies, so mlx-lm's own ``load_prompt_cache`` refuses a damaged kvq layer too;
- the metadata holds a checksum of every array and every metadata entry of the file
  (:data:`~kvq.cache.state.FILE_CHECKSUM`), which :func:`load_prompt_cache` verifies: it also covers layers that
  are not kvq's (a model's sliding-window layers) and the metadata.

Hashing (SHA-256, each array once) happens on save and load only, never on the decode path.
"""

from __future__ import annotations

import os

import attrs
import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx.utils import tree_flatten, tree_unflatten

from ..contract import Unfits, optional_hook
from ..plugins import UnknownMethodError
from . import patch as _patch
from .batch import BatchKVQCache
from .guard import guarded, safe_params
from .layer import CacheConfig, KVQCache
from .registration import CLASSES, register_with_mlx_lm
from .state import FILE_CHECKSUM, LAYER_CHECKSUM, as_stored, checksum, layer_checksum

#: Where the file's checksum sits among the flattened metadata: the caller's metadata is entry 0.
_CHECKSUM_KEY = f"0.{FILE_CHECKSUM}"


def save_prompt_cache(file_name: str, cache: list, metadata: dict[str, str] | None = None) -> None:
    """``mlx_lm.models.cache.save_prompt_cache`` with checksums (see the module docstring), for a list of caches of
    any kind, kvq's or mlx-lm's. The file loads with mlx-lm's ``load_prompt_cache`` as well as with
    :func:`load_prompt_cache` (in this process too: it calls :func:`~kvq.cache.registration.register_with_mlx_lm`).
    As mlx-lm's, it adds ``.safetensors`` to a name that does not end with it.

    Cost: every array is evaluated and hashed once (SHA-256, roughly 1 GB/s on one CPU core).

    :param metadata: strings to store with the caches (``load_prompt_cache(..., return_metadata=True)``).
    :raises ValueError: ``metadata`` is not a dict of strings to strings, uses kvq's key
        :data:`~kvq.cache.state.FILE_CHECKSUM`, or a cache's state holds a value that cannot be stored.
    """
    metadata = dict(metadata or {})
    odd = [f"{k!r}: {v!r}" for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
    if odd:
        raise ValueError(f"metadata: safetensors stores strings only (keys and values); got {', '.join(odd[:3])}"
                         f" (e.g. str(value))")
    if FILE_CHECKSUM in metadata:
        raise ValueError(f"metadata: the key {FILE_CHECKSUM!r} is kvq's (the file's checksum)")
    digests: dict = {}  # every array is hashed once, for its layer's checksum and the file's
    states = [_file_state(c, digests) for c in cache]
    arrays, scalars = {}, [""]  # mlx-lm's layout: the "" keeps the list from being flattened away
    for key, value in tree_flatten(states):
        if not isinstance(value, mx.array):
            scalars.append((key, _kind(value)))
        arrays[key] = as_stored(value)
    flat = dict(tree_flatten([metadata, [type(c).__name__ for c in cache], scalars]))
    flat[_CHECKSUM_KEY] = checksum(arrays.items(), flat.items(), digests)
    mx.save_safetensors(file_name, arrays, flat)
    register_with_mlx_lm()


def _file_state(cache, digests: dict):
    """``cache.state``, with each kvq layer's own checksum added."""
    if isinstance(cache, KVQCache):
        state = cache.state
        return {**state, LAYER_CHECKSUM: layer_checksum(state, digests)}
    if isinstance(cache, BatchKVQCache):
        return {"rows": [_file_state(row, digests) for row in cache.rows]}
    return cache.state


def _kind(value) -> str:
    """mlx-lm's name for how a value that is not an array is stored."""
    return "none" if value is None else "string" if isinstance(value, str) else "scalar"


def load_prompt_cache(file_name: str, *, expect: CacheConfig | None = None, return_metadata: bool = False):
    """``mlx_lm.models.cache.load_prompt_cache`` with kvq's checks; the file is only read, and nothing in the
    process changes when a check fails. Then patches mlx-lm's attention (:mod:`kvq.cache.patch`) and registers
    kvq's classes with mlx-lm (:func:`~kvq.cache.registration.register_with_mlx_lm`), as :func:`kvq.make_prompt_cache`
    does, so the caches work in a fresh process.

    A file written by :func:`save_prompt_cache` is verified against its checksum first: any changed byte of its
    arrays or metadata is refused. Files without a checksum (saved with mlx-lm's ``save_prompt_cache``, or by kvq
    before it wrote checksums) still load, with the checks that do not need one.

    :param expect: if given, the file must hold kvq layers, and every kvq layer must have this method and
        parameters (state that a layer fitted from data, such as TurboQuant's data-chosen outlier channels, comes
        from the file), or be an outlier layer stored with affine 8-bit (:mod:`kvq.cache.guard`). ``expect``'s
        sinks, window and flush are not compared: the file carries its own, and the loaded cache keeps them.
    :param file_name: the file; a name without ``.safetensors`` (as given to :func:`save_prompt_cache`, which adds
        it) is read with it where no file of the bare name exists.
    :raises FileNotFoundError: no file ``file_name`` (:class:`IsADirectoryError` for a directory).
    :raises ValueError: naming ``file_name``: a file that is truncated or damaged (it cannot be read, or it does
        not match its checksum), one written by another kvq format, one of a method that is not installed, or one
        with other methods/parameters than ``expect``.
    """
    if os.path.isdir(file_name):
        raise IsADirectoryError(f"prompt-cache file {file_name!r} is a directory")
    if not os.path.isfile(file_name) and os.path.isfile(f"{file_name}.safetensors"):
        file_name = f"{file_name}.safetensors"  # what save_prompt_cache(file_name, ...) wrote, as mlx-lm's does
    if not os.path.isfile(file_name):
        raise FileNotFoundError(f"prompt-cache file {file_name!r} does not exist")
    try:
        cache, metadata = _read(file_name)
    except (RuntimeError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, UnknownMethodError):  # written with a method this process does not have
            reason += "; the plugin that wrote it must be installed (or kvq.register-ed) to load it"
        raise ValueError(f"{file_name}: not a prompt-cache file that loads: {reason}") from exc
    if expect is not None:
        _check_expected(file_name, cache, expect)
    _patch.patch()
    register_with_mlx_lm()
    return (cache, metadata) if return_metadata else cache


def _read(file_name: str):
    """``(caches, metadata)`` of a file in mlx-lm's format, verified against its checksum where it has one."""
    try:
        arrays, flat = mx.load(file_name, return_metadata=True)
    except RuntimeError as exc:  # MLX's reader: a truncated file, a damaged header
        raise ValueError(f"it cannot be read (truncated or damaged?): {exc}") from None
    saved = flat.pop(_CHECKSUM_KEY, None)
    if saved is not None and saved != checksum(arrays.items(), flat.items()):
        raise ValueError("its arrays or metadata do not match the checksum saved with them: the file is corrupt "
                         "(damaged or changed after saving); recompute the cache")
    metadata, classes, scalars = tree_unflatten(list(flat.items()))
    for key, kind in scalars[1:]:  # as mlx-lm's loader restores them
        arrays[key] = _restore(arrays[key], kind)
    states = tree_unflatten(list(arrays.items()))
    if saved is not None:  # the file's checksum covered every layer: from_state need not hash them again
        states = [_without_layer_checksum(c, s) for c, s in zip(classes, states)]
    return [(CLASSES.get(c) or getattr(mlx_cache, c)).from_state(s) for c, s in zip(classes, states)], metadata


def _restore(array: mx.array, kind: str):
    if kind == "scalar":
        return array.item()
    if kind == "string":
        return "".join(chr(i) for i in array.tolist())
    if kind == "none":
        return None
    raise ValueError(f"unknown stored kind {kind!r}")


def _without_layer_checksum(class_name: str, state):
    """A kvq cache's state without its layers' own checksums (other caches' states unchanged)."""
    if class_name in ("KVQCache", "RotatingKVQCache"):
        return {k: v for k, v in state.items() if k != LAYER_CHECKSUM}
    if class_name == "BatchKVQCache":
        return {**state, "rows": [_without_layer_checksum("KVQCache", row) for row in state.get("rows", [])]}
    return state


def _check_expected(file_name: str, cache: list, expect: CacheConfig) -> None:
    if not any(getattr(c, "config", None) is not None for c in cache):  # mlx-lm's caches only: nothing matches
        kinds = sorted({type(c).__name__ for c in cache})
        raise ValueError(f"{file_name}: holds no kvq cache layer ({', '.join(kinds) or 'no layers'}), so not what "
                         f"expect= asks")
    safe = safe_params()
    for i, c in enumerate(cache):
        got, want = getattr(c, "config", None), expect.for_layer(i)
        if got is not None and want.budget is not None:  # a bits budget: the settings it buys (kvq.cache.budget)
            if got.budget != want.budget:
                held = "no bits budget" if got.budget is None else f"bits budget {got.budget:g}"
                raise ValueError(f"{file_name}: layer {i} does not hold what expect= asks: {held}, expected bits "
                                 f"budget {want.budget:g}")
            if c.layout is None:
                continue
            want = want.within_budget(c.layout[2], c.layout[3])
        if got is not None and got.outlier_layer and guarded(want.key_params) and _declared(got) == (safe, safe):
            continue  # an outlier layer the guard stored at 8 bits (kvq.cache.guard) where it expected fewer
        if got is not None and _declared(got) != _declared(want):
            differences = [f"{side} {_difference(g, w)}" for side, g, w in
                           zip(("keys", "values"), _declared(got), _declared(want)) if g != w]
            raise ValueError(f"{file_name}: layer {i} does not hold what expect= asks: {'; '.join(differences)}")


def _difference(got, want) -> str:
    """What differs between two sides' parameters, briefly: ``"affine bits 4, expected 8"`` for one method,
    ``"method 'turboquant', expected 'affine'"`` for two."""
    method_got, method_want = getattr(got, "method", None), getattr(want, "method", None)
    if type(got) is type(want) and attrs.has(type(got)):
        a, b = attrs.asdict(got, recurse=False), attrs.asdict(want, recurse=False)
        fields = [f"{k} {a[k]!r}, expected {b[k]!r}" for k in a if a[k] != b[k]]
        if fields:
            return f"{method_got} " + ", ".join(fields)
    if method_got is not None and method_want is not None and method_got != method_want:
        return f"method {method_got!r}, expected {method_want!r}"
    return f"{got!r}, expected {want!r}"


def _declared(config: CacheConfig) -> tuple:
    """``(key_params, value_params)`` without fitted state (parameters' optional ``unfitted()``:
    :class:`kvq.contract.Unfits`)."""
    return tuple(_unfitted(p) for p in (config.key_params, config.value_params))


def _unfitted(params):
    unfitted = optional_hook(params, Unfits)
    return params if unfitted is None else unfitted()
