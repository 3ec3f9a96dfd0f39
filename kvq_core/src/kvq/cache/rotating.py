"""``RotatingKVQCache``: a sliding-window layer's KV cache for mlx-lm, with its older tokens stored compressed.

mlx-lm's ``RotatingKVCache(max_size, keep)`` (sliding-window layers of Gemma 3, gpt-oss, Mistral; every layer under
``max_kv_size``) shows a query at position ``p``, in token-by-token decode, the first ``keep`` tokens and the newest
``max_size - keep`` tokens up to ``p``. This cache shows each query the same tokens, laid out as: the ``keep`` tokens
(uncompressed; the layer's sinks) | the older tokens of the window, compressed, in a :class:`~kvq.cache.ring.RingStore`
of ``max_size - keep - window`` tokens | the residual window (the newest ``window`` to ``window + flush - 1``
tokens, uncompressed). Memory is bounded by ``max_size`` and the compression ratio, never by the tokens generated.

Tokens are compressed exactly as in :class:`~kvq.cache.KVQCache` (same methods, sinks aside, guard and fitted
parameters); a token older than the window is overwritten in the ring. A prefill chunk gives each of its queries what
the token-by-token run shows it (:func:`kvq.cache.schedule.visible`). mlx-lm's own chunk mask differs from its decode where
``keep > 0``: it counts the ``keep`` tokens as the oldest positions of its window, so a chunk query past ``max_size``
does not see them; kvq follows the token-by-token rule in both. With ``keep = 0`` (what mlx-lm's models build for
their sliding layers) the two agree.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np

from . import engine
from .parts import Part, causal
from .prefill import after_chunk
from .config import CacheConfig
from .layer import KVQCache
from .reuse import check_trim, trimmable_now
from .ring import RingStore, concat_encoded
from .schedule import Fresh, visible
from .state import row_class


@row_class
class RotatingKVQCache(KVQCache):
    """A drop-in replacement for mlx-lm's ``RotatingKVCache(max_size, keep)`` that stores the window's older tokens
    compressed (see the module docstring). Build it with :func:`kvq.make_prompt_cache`, which gives one to every
    layer whose mlx-lm cache is a ``RotatingKVCache`` (and to every layer under ``max_kv_size``).

    Keys and values ``[B, H_kv, T, D]`` as :class:`KVQCache`; ``offset`` counts every token stored (RoPE),
    :meth:`size` those still visible (at most ``max_size``). Resident: ``keep + window + flush - 1`` uncompressed
    tokens and ``max_size - keep - window`` compressed ones (allocated in steps of ``config.step``). ``trim`` works
    while ``offset < max_size`` (as mlx-lm's); prompt-cache files and batching (:class:`BatchKVQCache` rows, so
    ``merge``/``extract``/``filter``/``extend``) work. :meth:`decoded` returns the compressed tokens in ring order.

    :param config: :class:`CacheConfig`; its ``sinks`` is replaced by ``keep`` and its ``window`` is capped at
        ``max_size - keep`` (a window that large leaves nothing to compress).
    :param max_size: mlx-lm's ``max_size``: tokens visible to a query, ``keep`` included (>= 1).
    :param keep: mlx-lm's ``keep``: first tokens visible to every query (0 <= keep < max_size).
    :raises ValueError: ``max_size`` or ``keep`` out of range.
    """

    _FAST_APPEND = False  # tokens go to the ring in _store
    PACKABLE = False  # a batch's rotating rows decode one by one

    def __init__(self, config: CacheConfig, max_size: int, keep: int = 0) -> None:
        if not isinstance(max_size, int) or isinstance(max_size, bool) or max_size < 1:
            raise ValueError(f"max_size must be an int >= 1; got {max_size!r}")
        if not isinstance(keep, int) or isinstance(keep, bool) or not 0 <= keep < max_size:
            raise ValueError(f"keep must be an int with 0 <= keep < max_size ({max_size}); got {keep!r}")
        self.max_size, self.keep = max_size, keep
        super().__init__(attrs.evolve(config, sinks=keep, window=min(config.window, max_size - keep)))
        limit = max_size - keep - self._config.window
        self.compressed_keys, self.compressed_values = RingStore(config.step, limit), RingStore(config.step, limit)
        self.left = 0  # tokens after the keep ones that have left the residual window (into the ring)

    # -- storage ------------------------------------------------------------------------------------
    def _store(self, keys, values) -> None:
        self.offset += keys.shape[2]
        keys, values = self._fill_sinks(keys, values)
        if keys.shape[2] <= 1:  # one token (or none): its query sees the cache as it is after the update
            self._fresh = None
            if keys.shape[2]:
                self._push(keys, values)
            return
        left, held = self.left, self.window.length
        before = (self.compressed_keys.ordered(), self.compressed_values.ordered())
        before_first = left - self.compressed_keys.length
        dense, encoded = self._push(keys, values)
        if encoded is not None:
            encoded = tuple(concat_encoded(b, e) for b, e in zip(before, encoded))
        elif before[0] is not None:
            encoded = before
        self._fresh = Fresh(self.offset - keys.shape[2], left, held, keys.shape[2], dense, encoded, before_first)

    def chunk_rows(self, count: int, query_start: int) -> None:
        """``None``: a rotating layer's chunk is attended by the layer alone (:meth:`KVQCache.chunk_rows`; its parts
        are a ring's)."""
        return None

    def first_block_span(self, tokens: int) -> None:
        """``None``: a rotating layer's first block is decided by the layer alone (:meth:`KVQCache.first_block_span`;
        its ring stores its own way)."""
        return None

    def _push(self, keys, values):
        """Append tokens after the ``keep`` ones to the residual window; those leaving it (:meth:`_leaving`) are
        compressed into the ring (dropped where the ring holds nothing: they are out of every later query's
        window). Returns the uncompressed window before the update followed by the new tokens (16-bit, as the window
        stores them: float32 is stored as float16), and the ``(keys, values)`` Encoded of the tokens compressed now
        (or ``None``)."""
        overflow = self._leaving(self.window.length, keys.shape[2])
        if not overflow:
            self.window.append(keys, values)
            return self.window.view(), None
        # in 16 bits as the window stores them: tokens of a chunk are seen and compressed exactly as one by one
        keys, values = (x.astype(mx.float16) if x.dtype == mx.float32 else x for x in (keys, values))
        held_k, held_v = self.window.view()
        if held_k is not None:
            keys, values = mx.concatenate([held_k, keys], axis=2), mx.concatenate([held_v, values], axis=2)
        encoded = None
        if self.compressed_keys.limit:
            self._fit_params(keys, values)
            encoded = self._encode(keys[:, :, :overflow], values[:, :, :overflow])
            self.compressed_keys.append(encoded[0])
            self.compressed_values.append(encoded[1])
        self.left += overflow
        self.window.replace(keys[:, :, overflow:], values[:, :, overflow:])
        return (keys, values), encoded

    # -- attention ----------------------------------------------------------------------------------
    def attend(self, queries: mx.array, scale: float, mask=None, sink_logits: mx.array | None = None,
               query_start: int | None = None) -> mx.array:
        """Attention of ``queries [B, H_q, T_q, D]`` (the newest ``T_q`` tokens, or those from ``query_start``) over
        the tokens each sees: the ``keep`` ones before it and the newest ``max_size - keep`` up to itself, as in
        a token-by-token run of mlx-lm's ``RotatingKVCache`` (:meth:`parts`; :mod:`kvq.cache.engine` attends them).

        :param mask: ``None`` or ``"causal"`` (what :meth:`make_mask` gives models); the window is enforced from
            token positions.
        :param sink_logits: learned attention-sink logits ``[H_q]`` (gpt-oss), or ``None``.
        :return: ``[B, H_q, T_q, D_v]`` in the queries' dtype.
        :raises ValueError: a mask array (padding is handled by :class:`BatchKVQCache`, which passes none).
        """
        Tq = queries.shape[2]
        fresh, self._fresh = self._fresh, None
        if mask is not None and not isinstance(mask, str):
            raise ValueError("a RotatingKVQCache takes no mask array: it applies its window from token positions "
                             "(batches go through BatchKVQCache, whose rows store no padding)")
        start_q = self.offset - Tq if query_start is None else query_start
        first_seen = max(0, min(start_q, self.offset - 1) - self.max_size + 1)  # the first row's first visible token
        if fresh is None and Tq == 1 and sink_logits is None and first_seen <= self.left - self.compressed_keys.length:
            fused = self._fused_attend(queries, scale)  # every held token is visible: KVQCache's fused decode
            if fused is not None:
                return fused
        out = engine.attend(queries, scale, self.parts(Tq, start_q, fresh), self._config, self._transform,
                            sink_logits=sink_logits)
        return out if self._ahead is None else self._settled(out, queries, scale, mask, sink_logits, query_start)

    def parts(self, count: int, start_q: int, fresh: Fresh | None = None) -> list[Part]:
        """The engine's parts (:meth:`KVQCache.parts`) of ``count`` query rows at positions ``start_q ...``: the
        ``keep`` tokens, causal among themselves; the compressed tokens (the ring as it is, indexed by its slots'
        ranks; or, for the chunk just stored, the ring before it followed by the tokens it compressed, up to what
        each row saw compressed: :func:`kvq.cache.schedule.visible`); the residual window (or the chunk's
        uncompressed tokens). Each row sees, after the ``keep`` tokens, indices ``[p - max_size + 1, p - keep + 1)``
        for its position ``p``; rows past the stored tokens (a padded batch row) see what the last stored token
        sees."""
        positions = np.minimum(np.arange(start_q, start_q + count), self.offset - 1)
        lo = np.maximum(0, positions - self.max_size + 1)  # the first visible token after the keep ones
        top = positions - self.keep + 1  # one past the last
        parts = []
        n = self.sinks.length
        if n:
            keys, values = self.sinks.view()
            parts.append(Part(keys, values, False, 0, *causal(n, 0, positions)))
        if fresh is None:
            ring = self.compressed_keys
            if ring.length:
                index = self.left - ring.length + ring.ranks()
                parts.append(Part(ring.view(), self.compressed_values.view(), True, index, lo,
                                         np.minimum(top, self.left)))
            window_k, window_v = self.window.view()
            if window_k is not None:
                parts.append(Part(window_k, window_v, False, self.left, lo, top))
            return parts
        compressed = visible(fresh, start_q, count, self._config.window, self._flush)  # per row: left by then
        if fresh.encoded is not None:
            keys, values = fresh.encoded
            total = keys.num_tokens
            a = min(total, max(0, int(lo[0]) - fresh.encoded_first))  # tokens before every row's window are skipped
            if a < total:
                parts.append(Part(keys.tokens(a, total), values.tokens(a, total), True,
                                         fresh.encoded_first + a + np.arange(total - a), lo,
                                         np.minimum(compressed, top)))
        dense_k, dense_v = fresh.dense
        parts.append(Part(dense_k, dense_v, False, fresh.compressed, np.maximum(lo, compressed), top))
        return parts

    # -- mlx-lm cache protocol ------------------------------------------------------------------------
    def size(self) -> int:
        """Tokens a query sees at most: ``min(offset, max_size)`` (as mlx-lm's ``RotatingKVCache.size``)."""
        return min(self.offset, self.max_size)

    def is_trimmable(self) -> bool:
        """Whether :meth:`trim` can remove tokens: while ``offset < max_size`` (no token has left the window yet),
        as mlx-lm's ``RotatingKVCache`` (and never inside :func:`kvq.cache.reuse.untrimmable`)."""
        return self.offset < self.max_size and trimmable_now()

    def trim(self, n: int) -> int:
        """Forget the newest ``n`` tokens (the residual window's, then the ring's, then the ``keep`` ones); returns
        how many were removed: 0 once the cache is not :meth:`is_trimmable` (tokens it would need again are gone).
        Tokens left behind keep the form they had, as in :meth:`KVQCache.trim` (and inexact trims are refused
        where that one refuses them)."""
        self.settle()
        if not self.is_trimmable():
            return 0
        check_trim(self, n)
        n = max(0, min(n, self.offset))
        rest = n - self.window.trim(n)
        if rest:
            self.compressed_values.trim(rest)
            taken = self.compressed_keys.trim(rest)
            self.left -= taken
            rest -= taken
        self.sinks.trim(rest)
        self.offset -= n
        if self.offset == 0:
            self.__init__(self._config, self.max_size, self.keep)  # a fresh cache accepts a new layout
            self._fitted = False  # and fits its mean and scales again from its next first block
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """mlx-lm's mask hook: the window and causality are applied from positions, so ``None`` for one token and
        ``"causal"`` for more.

        :raises ValueError: a ``window_size`` other than ``max_size`` (mlx-lm's models build their sliding caches
            with ``max_size`` equal to the window they ask for).
        """
        if window_size is not None and window_size != self.max_size:
            raise ValueError(f"this RotatingKVQCache shows each query its max_size={self.max_size} tokens; the model "
                             f"asks for a window of {window_size}")
        after_chunk()  # a forward pass begins: the last one's shared masks are dropped (KVQCache.make_mask)
        return None if N == 1 else "causal"

    # -- prompt-cache files ---------------------------------------------------------------------------
    @property
    def state(self) -> dict:
        """:attr:`KVQCache.state` (the ring's fields in slot order) plus ``max_size``, ``keep``, ``left`` (tokens
        that have left the residual window) and ``ring_next`` (the ring's next slot)."""
        return {**super().state, "max_size": self.max_size, "keep": self.keep, "left": self.left,
                "ring_next": self.compressed_keys.next}

    @classmethod
    def _state_arguments(cls, state: dict) -> dict:
        return {"max_size": int(state["max_size"]), "keep": int(state["keep"])}

    def _check_restored(self, state: dict) -> None:
        """Restore ``left`` and the ring's next slot; :raises ValueError: counts that do not add up."""
        self.left = int(state["left"])
        saved = state.get("keys") or {}
        held = next(iter(saved.values())).shape[2] if saved else 0
        rings = (self.compressed_keys, self.compressed_values)
        next_slot = int(state["ring_next"])
        fits = next_slot == held % max(1, rings[0].limit) or (held == rings[0].limit and 0 <= next_slot < held)
        stored = self.sinks.length + self.left + self.window.length
        if stored != self.offset or any(r.length != held for r in rings) or held > self.left or not fits:
            raise ValueError(f"prompt cache: a rotating layer of offset {self.offset} holding {self.sinks.length} "
                             f"keep, {held} ring (of {self.left} compressed, next slot {next_slot}) and "
                             f"{self.window.length} window tokens; the file is inconsistent")
        for ring in rings:
            ring.next = next_slot
