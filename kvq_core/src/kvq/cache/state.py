"""The configuration block of a saved prompt cache: JSON with a format version and the kvq version."""

from __future__ import annotations

import json

import attrs
import mlx.core as mx

from ..plugins import registry

#: Bumped whenever the saved layout changes; files of another format are refused.
FORMAT = 1


def config_to_json(config, layout) -> str:
    """Serialise a :class:`CacheConfig` and the layout ``(B, H, D_k, D_v, dtype)`` (or ``None``)."""
    from .. import __version__

    return json.dumps({
        "format": FORMAT, "kvq": __version__,
        "key_method": config.key_params.method, "key_params": attrs.asdict(config.key_params),
        "value_method": config.value_params.method, "value_params": attrs.asdict(config.value_params),
        "sinks": config.sinks, "window": config.window, "step": config.step, "flush": config.flush,
        "layout": None if layout is None else [*layout[:4], str(layout[4]).split(".")[-1]],
    }, sort_keys=True)


def config_from_json(text: str):
    """Inverse of :func:`config_to_json`: ``(CacheConfig, layout)``.

    :raises ValueError: not a kvq cache block, another format version, or a method that is not installed.
    """
    from .layer import CacheConfig

    try:
        data = json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"prompt cache: not a kvq cache configuration ({exc})") from None
    if data.get("format") != FORMAT:
        raise ValueError(f"prompt cache: file format {data.get('format')!r} (written by kvq {data.get('kvq')}) "
                         f"is not supported by this kvq, which reads format {FORMAT}; recompute the cache")
    reg = registry()
    key_params = reg.method(data["key_method"]).make_params(**data["key_params"])
    value_params = reg.method(data["value_method"]).make_params(**data["value_params"])
    layout = data["layout"]
    if layout is not None:
        layout = (*layout[:4], getattr(mx, layout[4]))
    return CacheConfig(key_params, value_params, data["sinks"], data["window"], data["step"],
                       flush=data.get("flush", 1)), layout


def describe(text: str) -> dict:
    """The raw configuration dict of a saved cache (for error messages and ``kvq`` tools)."""
    return json.loads(text)
