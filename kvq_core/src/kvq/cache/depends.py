"""A cache's ``keys`` and ``values`` attributes, which are not its keys and values: mlx-lm's pipeline parallelism.

mlx-lm's pipelined models (mlx-lm 0.32: qwen2, qwen3_moe, deepseek_v2/v3, glm4_moe, mistral4, ministral3 ...) run
``cache[-1].keys = mx.depends(cache[-1].keys, h)`` on every rank that sends ``h`` on, because ``generate_step``
evaluates only ``[c.state for c in cache]`` and the send must be part of that graph (issue #10). Nothing else in
mlx-lm reads a kvq cache's keys or values: masks come from ``make_mask``, emptiness from ``empty()``, files from
``state``, batching from ``merge``/``extract``. So these are one stored array each, which the state contains.
"""

from __future__ import annotations

import mlx.core as mx


class DependencySlots:
    """Mixin of :class:`kvq.cache.KVQCache` (and its subclasses): ``keys``/``values`` as one stored array each, for
    ``mx.depends``. Reads the cache's ``window``, ``sinks``, ``compressed_keys`` and ``compressed_values``."""

    @property
    def keys(self) -> mx.array | None:
        """Not the keys: one array that stores key data, for ``cache.keys = mx.depends(cache.keys, h)``
        (``None`` when the cache is empty).

        Which array: the residual window's keys buffer ``[B, H_kv, window + flush - 1, D]`` (preallocated, so
        beyond the held tokens it is zeros) while the window holds tokens, else the alphabetically first field of
        the compressed keys' store ``[B, H_kv, capacity, ...]`` (e.g. ``codes``), else the sinks' buffer
        ``[B, H_kv, sinks, D]``. :attr:`state` contains it, so an array assigned back keeps its dependency
        evaluated with the state for as long as those tokens stay in that part.
        """
        holder, name = self._dependency_slot("keys")
        return None if holder is None else holder[name]

    @keys.setter
    def keys(self, value) -> None:
        """Replace the array :attr:`keys` returns by ``value`` of the same shape and dtype (such as
        ``mx.depends(cache.keys, h)``); other assignments would corrupt the store and are refused.

        :raises ValueError: ``value`` is not an array of that shape and dtype (or not ``None`` on an empty cache).
        """
        self._replace_dependency_slot("keys", value)

    @property
    def values(self) -> mx.array | None:
        """As :attr:`keys`, for the values: not the values, one array that stores value data."""
        holder, name = self._dependency_slot("values")
        return None if holder is None else holder[name]

    @values.setter
    def values(self, value) -> None:
        """As the :attr:`keys` setter, for the values."""
        self._replace_dependency_slot("values", value)

    def _dependency_slot(self, side: str):
        """``(dict, name)`` where :attr:`keys` (``side="keys"``) or :attr:`values` is held, or ``(None, None)``
        when the cache is empty. A chunk's first compression is settled first (its stores may be replaced)."""
        self.settle()
        store = self.compressed_keys if side == "keys" else self.compressed_values
        if self.window.length:
            return vars(self.window), side
        if store.length:
            return store.data, min(store.data)
        if self.sinks.length:
            return vars(self.sinks), side
        return None, None

    def _replace_dependency_slot(self, side: str, value) -> None:
        holder, name = self._dependency_slot(side)
        current = None if holder is None else holder[name]
        if current is None and value is None:
            return
        if current is None or not isinstance(value, mx.array) or value.shape != current.shape or \
                value.dtype != current.dtype:
            want = "None (the cache is empty)" if current is None else \
                f"an mx.array of shape {tuple(current.shape)} and dtype {current.dtype}"
            got = f"{type(value).__name__} {tuple(getattr(value, 'shape', ()))} {getattr(value, 'dtype', '')}"
            raise ValueError(f"{side}: a kvq cache accepts only {want} (the array it returned, e.g. through "
                             f"mx.depends); got {got.strip()}")
        store = self.compressed_keys if side == "keys" else self.compressed_values
        if holder is store.data:
            store.replace_field(name, value)  # its cached view must not keep the array without the dependency
        else:
            holder[name] = value
