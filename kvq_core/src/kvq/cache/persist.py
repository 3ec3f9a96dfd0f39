"""Prompt-cache files of a kvq layer: what ``state`` holds and how a cache is rebuilt from it (mlx-lm's
``save_prompt_cache``/``load_prompt_cache`` call ``state`` and ``from_state``), and the public constructor that
rebuilds a cache from its parts (:meth:`PromptCacheState.restore`), which a batch's packed rows use too."""

from __future__ import annotations

import mlx.core as mx

from ..encoded import Encoded
from .config import CacheConfig
from .state import check_layer, config_from_json, config_to_json
from .store import spare


class PromptCacheState:
    """Mixin of :class:`kvq.cache.KVQCache` (and its subclasses): ``state``, ``from_state`` and ``restore``. A
    subclass whose constructor takes more than the configuration names it in :meth:`_state_arguments` and checks
    its own entries in :meth:`_check_restored`."""

    @property
    def state(self) -> dict:
        """Everything needed to rebuild this cache, for ``mlx_lm.models.cache.save_prompt_cache``: the compressed form.

        A dict of arrays (compressed fields trimmed to the stored length; ``key_mean`` and ``key_scale``, float32
        ``[B, H, 1, D_k]``, for a centred or scaled layer only), ints and one JSON string holding the configuration, the layout, the
        kvq version and the file-format version. A chunk's first compression is settled first
        (:meth:`kvq.cache.KVQCache.settle`: an outlier layer's chunk may be stored again).
        """
        self.settle()
        keys, values = self.compressed_keys.view(), self.compressed_values.view()
        transform = {name: x for name, x in (("key_mean", self.key_mean), ("key_scale", self.key_scale))
                     if x is not None}
        return {
            **transform,
            "config": self._config_json(),
            "offset": self.offset,
            "sink_keys": self.sink_keys, "sink_values": self.sink_values,
            "window_keys": self.window_keys, "window_values": self.window_values,
            "keys": {} if keys is None else dict(keys.data),
            "values": {} if values is None else dict(values.data),
        }

    def _config_json(self) -> str:
        """:func:`kvq.cache.state.config_to_json` of this cache's configuration and layout, made again only when
        either has changed: mlx-lm reads ``state`` after every prefill chunk of every layer (``generate_step``
        evaluates it), where building the JSON each time cost about 60 us per layer and chunk on an H100's host."""
        made = self.__dict__.get("_state_json")
        if made is None or made[0] is not self.config or made[1] != self._layout:
            made = self._state_json = (self.config, self._layout, config_to_json(self.config, self._layout))
        return made[2]

    @classmethod
    def restore(cls, config: CacheConfig, layout: tuple | None, offset: int, *, sinks: tuple | None = None,
                window: tuple | None = None, compressed: tuple | None = None, key_mean: mx.array | None = None,
                key_scale: mx.array | None = None, **kwargs):
        """A cache holding the given tokens, as :meth:`from_state` and a batch's packed rows (:meth:`kvq.cache.
        packed.PackedRows.row`) rebuild one (copies of the tokens: the cache keeps none of those arrays).

        :param layout: ``(B, H_kv, D_k, D_v, dtype)``, or ``None`` for an empty cache.
        :param sinks, window: ``(keys, values)`` ``[B, H_kv, n, D]`` of the held tokens, or ``None``.
        :param compressed: ``(keys, values)`` :class:`kvq.Encoded` of the compressed tokens, or ``None``.
        :param key_mean: a centred layer's key mean (float32 ``[B, H_kv, 1, D_k]``), or ``None``.
        :param key_scale: a scaled layer's key scales (float32 ``[B, H_kv, 1, D_k]``, powers of two), or ``None``.
        :param kwargs: what a subclass's constructor takes besides ``config`` (a rotating cache's ``max_size``, ``keep``).

        ``key_mean`` and ``key_scale`` are kept as given (small and never written in place).
        """
        cache = cls(config, **kwargs)
        cache._layout = layout
        if layout is not None:
            B, H, Dk, Dv, dtype = layout
            cache._token_shapes = ((B, H, 1, Dk), (B, H, 1, Dv), dtype)
        cache.offset = offset
        cache._transform.set(key_mean, key_scale)
        for buffer, tokens in ((cache.sinks, sinks), (cache.window, window)):
            if tokens is not None and tokens[0] is not None:
                buffer.replace(*tokens)
        if compressed is not None:  # with the next flush's room, as a compression leaves it (store.spare)
            room = spare(compressed[0].num_tokens, cache.config.flush_tokens)
            cache.compressed_keys.append(compressed[0], spare=room)
            cache.compressed_values.append(compressed[1], spare=room)
        return cache

    @classmethod
    def from_state(cls, state: dict):
        """Rebuild a cache from :attr:`state` (what ``mlx_lm.models.cache.load_prompt_cache`` calls), and patch
        mlx-lm's attention (:mod:`kvq.cache.patch`) so that a model loaded before uses it.

        A state saved by :func:`kvq.save_prompt_cache` holds its checksum, verified here first; a state without one
        (saved with mlx-lm's ``save_prompt_cache``, or before kvq wrote checksums) is rebuilt unchecked.

        :raises ValueError: a state that does not match its checksum (a corrupt file), a file of another format
            version, or of a method that is not installed, or inconsistent contents; the message says which.
        """
        check_layer(state)
        config, layout = config_from_json(state["config"])
        mean, key_scale = (_transform_array(state, name, layout) for name in ("key_mean", "key_scale"))
        head_dims = (None, None) if layout is None else (layout[2], layout[3])
        compressed = None
        if state.get("keys"):
            compressed = (Encoded(config.key_params, dict(state["keys"]), head_dims[0]),
                          Encoded(config.value_params, dict(state["values"]), head_dims[1]))
        cache = cls.restore(config, layout, int(state["offset"]), key_mean=mean, key_scale=key_scale,
                            sinks=(state.get("sink_keys"), state.get("sink_values")),
                            window=(state.get("window_keys"), state.get("window_values")), compressed=compressed,
                            **cls._state_arguments(state))
        cache._check_restored(state)
        from . import patch

        patch.patch()  # mlx-lm's loader gives no other moment: without it attention would get the stand-ins
        return cache

    @classmethod
    def _state_arguments(cls, state: dict) -> dict:
        """What this class's constructor takes besides the configuration, read from ``state`` (a subclass's own
        entries)."""
        return {}

    def _check_restored(self, state: dict) -> None:
        """:raises ValueError: the tokens :meth:`from_state` restored do not add up to ``offset``."""
        stored = self.sinks.length + self.window.length + self.compressed_keys.length
        if stored != self.offset:
            raise ValueError(f"prompt cache: {stored} tokens stored but offset is {self.offset}; the file is "
                             f"inconsistent")


def _transform_array(state: dict, name: str, layout: tuple | None) -> mx.array | None:
    """``state``'s ``key_mean`` or ``key_scale`` (``name``), checked against the layout; ``None`` where the file has
    none (a layer that is not centred or scaled; files written before kvq scaled keys have no ``key_scale``).

    :raises ValueError: an array whose shape or dtype does not fit the layout, or scales that are not positive
        powers of two (a corrupt file)."""
    array = state.get(name)
    if array is None or not array.size:
        return None
    want = None if layout is None else (layout[0], layout[1], 1, layout[2])
    if want is None or tuple(array.shape) != want or array.dtype != mx.float32:
        raise ValueError(f"prompt cache: {name} of shape {tuple(array.shape)} ({array.dtype}) does not fit the "
                         f"layout {want} (float32); the file is inconsistent")
    if name == "key_scale":
        exponent = mx.log2(array)
        if not bool(mx.all((array > 0) & mx.isfinite(array) & (exponent == mx.round(exponent)))):
            raise ValueError("prompt cache: key_scale holds values that are not positive powers of two; the file "
                             "is inconsistent")
    return array
