"""Compressed tokens of a sliding-window layer: an :class:`EncodedStore` that holds at most ``limit`` tokens in a ring.

Until it holds ``limit`` tokens it grows in steps like :class:`EncodedStore` (tokens in slots ``0, 1, ...``); then each
new token overwrites the oldest one's slot, so memory stays ``limit`` tokens however many pass through (the pattern of
mlx-lm's ``RotatingKVCache``, for codes and side data). Attention does not depend on the order of its keys, so
:meth:`RingStore.view` hands the held tokens over in slot order without a copy; :meth:`RingStore.ordered` gives them
oldest first and :meth:`RingStore.ranks` says how old each slot's token is, for masks.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..encoded import Encoded
from .store import EncodedStore, write_fields


def concat_encoded(first: Encoded | None, second: Encoded | None) -> Encoded | None:
    """The tokens of ``first`` followed by those of ``second`` (one of them may be ``None``); a copy of every field
    along axis 2. Both must share fields, parameters and head_dim (two blocks of one store)."""
    if first is None or second is None:
        return second if first is None else first
    return Encoded(second.params, {k: mx.concatenate([first.data[k], v], axis=2) for k, v in second.data.items()},
                   second.head_dim)


class RingStore(EncodedStore):
    """Encoded tokens along axis 2, at most ``limit`` of them: the newest ``limit`` appended.

    Slots ``[0, length)`` are the held tokens; ``next`` is the slot the next token goes to. While the ring has not
    wrapped, slot ``i`` holds the ``i``-th oldest token (``next == length``, or 0 once exactly full); once it has,
    the oldest token sits at ``next`` and ``length == limit``.

    :param step: tokens per growth step (capacity never exceeds ``limit``).
    :param limit: the most tokens held (>= 0; 0 holds nothing, appends are dropped).
    """

    def __init__(self, step: int, limit: int) -> None:
        super().__init__(step)
        self.limit = limit
        self.next = 0

    @property
    def wrapped(self) -> bool:
        """Whether the oldest held token is not in slot 0 (the ring has overwritten tokens)."""
        return self.length == self.limit and self.next != 0

    def append(self, encoded: Encoded, spare: int = 0) -> None:
        """Store ``encoded``'s tokens as the newest, overwriting the oldest beyond ``limit`` (only the newest
        ``limit`` of ``encoded`` are written when it holds more).

        :param spare: as :meth:`EncodedStore.append` (the capacity never exceeds ``limit``).

        :raises ValueError: ``encoded`` has other fields, params or head_dim than what is stored.
        """
        n = encoded.num_tokens
        if self.data is not None and (set(encoded.data) != set(self.data) or encoded.params != self.params):
            raise ValueError(f"encoded: fields/params {sorted(encoded.data)} {encoded.params!r} differ from the "
                             f"stored {sorted(self.data)} {self.params!r}")
        if self.limit == 0 or n == 0:
            return
        if n >= self.limit:  # only the newest limit tokens survive: they fill the ring from slot 0
            encoded, n = encoded.tokens(n - self.limit, n), self.limit
            self.length = self.next = 0
        if self.next + n + spare > self.capacity and self.capacity < self.limit:  # (only before wrapping)
            self.params, self.head_dim = encoded.params, encoded.head_dim
            self._grow_to(encoded.data, min(self.next + n + spare, self.limit))
        if self.next + n <= self.capacity:
            self._write(encoded, self.next)
            self.next = (self.next + n) % self.limit
            self.length = min(self.limit, self.length + n)
        else:  # past the last slot (capacity == limit): the part up to it, then the rest from slot 0
            head = self.limit - self.next
            self._write(encoded.tokens(0, head), self.next)
            self._write(encoded.tokens(head, n), 0)
            self.next, self.length = n - head, self.limit

    def reserve(self, tokens: int) -> None:
        """As :meth:`EncodedStore.reserve`, never above ``limit`` (a full ring does not grow)."""
        tokens = min(tokens, self.limit)
        if self.data is not None and tokens > self.capacity:
            self._grow_to(self.data, tokens)

    def _grow_to(self, like: dict[str, mx.array], needed: int) -> None:
        """Capacity for ``needed`` (<= ``limit``) tokens, in whole steps but never above ``limit``: the held tokens
        (slots ``[0, length)``: the ring has not wrapped) followed by zeros shaped like ``like``'s fields, one
        concatenation per field."""
        capacity = min(self.limit, -(-needed // self.step) * self.step)
        grown = {}
        for name, array in like.items():
            shape = list(array.shape)
            shape[2] = capacity - self.length
            block = mx.zeros(shape, array.dtype)
            held = None if self.data is None else self.data[name][:, :, : self.length]
            grown[name] = block if held is None or not self.length else mx.concatenate([held, block], axis=2)
        self.data = grown
        self._view = None

    def _write(self, encoded: Encoded, slot: int) -> None:
        """Copy ``encoded``'s tokens into slots ``slot ...`` (in place: a slice assignment per field)."""
        self._view = None  # first: a view would make the write a copy (write_fields)
        write_fields(self.data, encoded, slot)

    def ordered(self) -> Encoded | None:
        """The held tokens oldest first (a slice, or where the ring has wrapped a concatenation of two); ``None``
        when empty."""
        view = self.view()
        if view is None or not self.wrapped:
            return view
        return concat_encoded(view.tokens(self.next, self.length), view.tokens(0, self.next))

    def ranks(self) -> np.ndarray:
        """int64 ``[length]``: for each slot, the age rank of its token (0 = the oldest held)."""
        slots = np.arange(self.length)
        return (slots - self.next) % self.length if self.wrapped else slots

    def trim(self, n: int) -> int:
        """Forget the newest ``n`` tokens; returns how many.

        :raises ValueError: the ring has wrapped (its oldest tokens are gone; kvq's rotating cache is not trimmable
            then, as mlx-lm's ``RotatingKVCache`` is not).
        """
        if self.wrapped and n:
            raise ValueError("a ring that has overwritten tokens cannot be trimmed")
        n = super().trim(n)
        self.next = self.length % max(self.limit, 1)
        return n
