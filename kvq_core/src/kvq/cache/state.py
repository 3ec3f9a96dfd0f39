"""What a saved prompt cache holds besides the arrays: the configuration block (JSON with a format version and the
kvq version) and the checksums that :func:`kvq.save_prompt_cache` writes and the loaders verify."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

import attrs
import mlx.core as mx
from mlx.utils import tree_flatten

from ..plugins import registry
from .config import CacheConfig

#: Bumped whenever the saved layout changes. 2: a layer may hold ``key_mean`` (centred keys, :mod:`kvq.cache.guard`),
#: which a reader of format 1 would ignore and so misread. 3: a layer may hold ``key_scale`` (scaled keys), which a
#: reader of format 2 would ignore.
FORMAT = 3
#: Formats this kvq reads (a format-1 file holds no centred layer, a format-2 one no scaled layer); files of another
#: format are refused.
READABLE_FORMATS = (1, 2, 3)


#: kvq's cache classes by name (:func:`row_class`): what a batch's file names its rows by.
ROW_CLASSES: dict[str, type] = {}


def row_class(cls: type) -> type:
    """Class decorator: record a single-sequence cache class (:class:`kvq.cache.KVQCache` and its subclasses) under
    its name in :data:`ROW_CLASSES`, so that a batch's rows are rebuilt from a file without the batch module
    importing the cache classes (:meth:`kvq.cache.BatchKVQCache.from_state`)."""
    ROW_CLASSES[cls.__name__] = cls
    return cls


def config_to_json(config, layout) -> str:
    """Serialise a :class:`CacheConfig` and the layout ``(B, H, D_k, D_v, dtype)`` (or ``None``)."""
    from .. import __version__

    return json.dumps({
        "format": FORMAT, "kvq": __version__,
        "key_method": config.key_params.method, "key_params": attrs.asdict(config.key_params),
        "value_method": config.value_params.method, "value_params": attrs.asdict(config.value_params),
        "sinks": config.sinks, "window": config.window, "step": config.step, "flush": config.flush,
        "outlier_layer": config.outlier_layer, "budget": config.budget,
        "still_channels": None if config.still_channels is None else list(config.still_channels),
        "layout": None if layout is None else [*layout[:4], str(layout[4]).split(".")[-1]],
    }, sort_keys=True)


def config_from_json(text: str):
    """Inverse of :func:`config_to_json`: ``(CacheConfig, layout)``.

    :raises ValueError: not a kvq cache block, another format version, or a method that is not installed.
    """

    try:
        data = json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"prompt cache: not a kvq cache configuration ({exc})") from None
    if data.get("format") not in READABLE_FORMATS:
        raise ValueError(f"prompt cache: file format {data.get('format')!r} (written by kvq {data.get('kvq')}) "
                         f"is not supported by this kvq, which reads formats "
                         f"{', '.join(map(str, READABLE_FORMATS))}; recompute the cache")
    reg = registry()
    key_params = reg.method(data["key_method"]).make_params(**data["key_params"])
    value_params = reg.method(data["value_method"]).make_params(**data["value_params"])
    layout = data["layout"]
    if layout is not None:
        layout = (*layout[:4], getattr(mx, layout[4]))
    return CacheConfig(key_params, value_params, data["sinks"], data["window"], data["step"],
                       flush=data.get("flush", 1), outlier_layer=data.get("outlier_layer", False),
                       budget=data.get("budget"), still_channels=data.get("still_channels")), layout


def describe(text: str) -> dict:
    """The raw configuration dict of a saved cache (for error messages and ``kvq`` tools)."""
    return json.loads(text)


# -- checksums --------------------------------------------------------------------------------------------
#: Key of the file's checksum in a prompt-cache file's metadata (beside the caller's own metadata).
FILE_CHECKSUM = "kvq_checksum"
#: Key of a kvq layer's own checksum in its state (what ``mlx_lm.models.cache.load_prompt_cache`` hands
#: ``from_state``).
LAYER_CHECKSUM = "checksum"


def as_stored(value) -> mx.array:
    """A state value as mlx-lm's prompt-cache files store it: an array as it is; an int, float or bool as a 0-d
    array, a string as its code points, ``None`` as an empty array (``mlx_lm.models.cache.save_prompt_cache``).

    :raises ValueError: any other value (mlx-lm cannot store it either).
    """
    if isinstance(value, mx.array):
        return value
    if isinstance(value, (int, float, bool)):
        return mx.array(value)
    if isinstance(value, str):
        return mx.array([ord(c) for c in value])
    if value is None:
        return mx.array([])
    raise ValueError(f"prompt cache: a state value of type {type(value).__name__} cannot be stored")


def array_digest(array: mx.array) -> bytes:
    """SHA-256 of an array's bytes in row-major order (bfloat16 read as uint16: not every buffer reader knows
    it). Evaluates and copies the array to host memory: for saving and loading, never for a decode step."""
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return hashlib.sha256(memoryview(mx.contiguous(array))).digest()


def checksum(arrays: Iterable[tuple[str, mx.array]], texts: Iterable[tuple[str, str]] = (),
             digests: dict | None = None) -> str:
    """A hex SHA-256 over named arrays (each name, dtype, shape and :func:`array_digest`) and named strings,
    in name order, so it does not depend on the order entries are listed in.

    :param digests: ``id(array) -> (array, array_digest)`` of arrays already hashed (filled in; holding the array
        keeps its id from being reused): one save hashes each array once for its layer's checksum and the file's.
    """
    digests = {} if digests is None else digests
    h = hashlib.sha256()
    for name, array in sorted(arrays, key=lambda item: item[0]):
        if id(array) not in digests:
            digests[id(array)] = (array, array_digest(array))
        h.update(f"array\0{name}\0{array.dtype}\0{tuple(array.shape)}\0".encode())
        h.update(digests[id(array)][1])
    for name, text in sorted(texts):
        h.update(f"text\0{name}\0{len(text)}\0{text}".encode())
    return h.hexdigest()


def layer_checksum(state: dict, digests: dict | None = None) -> str:
    """The checksum of a :class:`KVQCache` state (its own :data:`LAYER_CHECKSUM` entry left out), over each value
    as the file stores it (:func:`as_stored`), so the state ``from_state`` receives from a file gives the same."""
    return checksum(((k, as_stored(v)) for k, v in tree_flatten(state) if k != LAYER_CHECKSUM), digests=digests)


def check_layer(state: dict) -> None:
    """Verify a kvq layer's state against its saved checksum; a state without one (a file saved before kvq
    wrote checksums, or not through :func:`kvq.save_prompt_cache`) passes unchecked.

    :raises ValueError: the state does not match its checksum (the file is corrupt).
    """
    saved = state.get(LAYER_CHECKSUM)
    if saved is not None and saved != layer_checksum(state):
        raise ValueError("prompt cache: a kvq layer's stored arrays do not match the checksum saved with them: the "
                         "file is corrupt (damaged or changed after saving); recompute the cache")
