"""``BatchKVQCache``: kvq caches for mlx-lm's batched generation (``BatchGenerator``, ``mlx_lm.server``).

Each sequence keeps its own :class:`KVQCache` (or :class:`RotatingKVQCache`) row, so sequences of different
lengths need no padding in the compressed store: right padding announced by ``prepare`` is simply not stored, and
attention runs per row with that row's token positions. Rows are independent, so ``merge``/``extract``/``filter``/
``extend`` move rows.

Decode packs the rows (:mod:`kvq.cache.packed`): once every row is past its prefill, the batch holds them as one
store with per-row token counts, so a decode step appends and attends all rows at once (one kernel launch per
layer on CUDA) instead of once per row. Anything else (a prefill chunk, ``extend``, ``extract``, files, ``trim``)
unpacks them first; :attr:`BatchKVQCache.pack` turns packing off.
"""

from __future__ import annotations

import copy
import functools

import mlx.core as mx

from . import engine
from .guard import SharedFirstBlocks
from .packed import PackedRows
from .state import ROW_CLASSES
from .views import CompressedView


def _rows(x: mx.array) -> list:
    """``x [B, ...]`` as ``B`` arrays ``[1, ...]``: one split (one graph operation, views of ``x``) rather than a
    slice per row; ``[x]`` itself for one row."""
    return [x] if x.shape[0] == 1 else mx.split(x, x.shape[0], axis=0)


class BatchKVQCache:
    """A batch of :class:`KVQCache` rows behind mlx-lm's batch-cache interface.

    :param rows: one single-sequence cache per batch entry (``B = 1`` each).
    """

    #: Whether decode packs the rows into one batched store (:mod:`kvq.cache.packed`); off: every row updates and
    #: attends on its own (the same tokens, one launch per row).
    pack = True
    #: Marks kvq's caches for mlx-lm's patched attention (:func:`kvq.cache.views.is_kvq_cache`).
    KVQ_CACHE = True

    def __init__(self, rows: list) -> None:
        self._rows = list(rows)
        self._packed = None  # PackedRows while decoding packed (then _rows is None)
        self._remaining = None  # real tokens still to come per row during a padded prefill
        self._starts = [0] * len(self._rows)  # position of each row's first query in the current step

    @property
    def rows(self) -> list:
        """The single-sequence caches, one per batch entry (packed rows are unpacked first)."""
        if self._packed is not None:
            self._rows, self._packed = self._packed.unpack(), None
        return self._rows

    @rows.setter
    def rows(self, rows) -> None:
        self._rows, self._packed = list(rows), None

    @property
    def packed(self) -> bool:
        """Whether the rows are packed now (decode in one call for all rows)."""
        return self._packed is not None

    @property
    def offset(self) -> mx.array:
        """Per-row token counts (mlx-lm uses them as RoPE offsets)."""
        if self._packed is not None:
            return self._packed.offset()
        return mx.array([r.offset for r in self.rows])

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Announce the real lengths of the next (right-padded) tokens; padding is never stored."""
        if left_padding is not None and any(left_padding):
            raise ValueError("BatchKVQCache stores no padding: left_padding must be zeros; got "
                             f"{list(left_padding)}")
        if lengths is not None and right_padding is not None and max(right_padding) > 0:
            self._remaining = list(lengths)

    def finalize(self) -> None:
        """End of a padded prefill."""
        self._remaining = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store ``[B, H, T, D]`` keys/values row by row (only each row's real tokens); returns stand-ins for the
        batch (:meth:`keys_and_values`)."""
        if keys.shape[0] != self._batch():
            raise ValueError(f"keys: batch of {keys.shape[0]} for a cache of {self._batch()} rows")
        T = keys.shape[2]
        if T == 1 and self._remaining is None and self.pack:
            if self._packed is None:
                packed = PackedRows.pack(self._rows)
                if packed is not None:
                    self._rows, self._packed = None, packed
            if self._packed is not None:
                self._starts = list(self._packed.offsets)
                unpacked = self._packed.append(keys, values)
                if unpacked is not None:  # a row's first compression did not match the pack: rows from here on
                    rows, done = unpacked
                    self.rows = rows
                    row_keys, row_values = _rows(keys), _rows(values)
                    for i, row in enumerate(rows):
                        if i not in done:
                            row.update_and_fetch(row_keys[i], row_values[i])
                return self.keys_and_values()
        # one split per side instead of a slice per row (decode on a GPU is bound by the host: every graph
        # operation a row adds per layer and step counts)
        row_keys, row_values = _rows(keys), _rows(values)
        rows = self.rows
        counts = [T] * len(rows) if self._remaining is None else [min(T, r) for r in self._remaining]
        if len(counts) != len(rows):
            raise RuntimeError(f"BatchKVQCache: {len(counts)} remaining prompt lengths for {len(rows)} rows")
        # a row's chunk makes its first compression without waiting for the device (kvq.cache.guard.decide_ahead):
        # each row settles its first block's decisions when it attends, by when the device has made them all; rows
        # that start a prefill together decide theirs in one graph
        planned = self._share_first_blocks(rows, counts, keys)
        try:
            for i, (row, n) in enumerate(zip(rows, counts)):
                self._starts[i] = row.offset
                self._update_row(i, row, row_keys[i], row_values[i], n)
        finally:  # a row whose update did not run (an earlier row's raised) keeps no plan of this chunk's
            for i in planned:
                rows[i].share_first_block(None)
        return self.keys_and_values()

    @staticmethod
    def _share_first_blocks(rows: list, counts: list, keys: mx.array) -> list:
        """Where two or more rows make their first compression in this chunk from empty caches
        (:meth:`KVQCache.first_block_span`, the same span of the chunk for each), their first blocks are decided in
        one graph (:class:`kvq.cache.guard.SharedFirstBlocks`): per row and layer the guard's statistics were about 40
        graph nodes for the host to build and encode, most of the host's work in a batch's first chunk (issue #51).
        Returns the rows given the shared decisions."""
        if keys.shape[2] < 2:
            return []
        spans = [row.first_block_span(n) for row, n in zip(rows, counts)]
        first = next((span for span in spans if span is not None), None)
        chosen = [i for i, span in enumerate(spans) if span is not None and span == first]
        if len(chosen) < 2:
            return []
        start, stop = first
        block = keys[:, :, start:stop]
        if len(chosen) < len(rows):
            block = block[mx.array(chosen)]
        shared = SharedFirstBlocks(mx.expand_dims(block, 1))
        for r, i in enumerate(chosen):
            rows[i].share_first_block(functools.partial(shared.decide, r))
        return chosen

    def _update_row(self, i: int, row, keys: mx.array, values: mx.array, n: int) -> None:
        """Store the first ``n`` of ``keys``/``values`` ``[1, H, T, D]`` in row ``i`` (its real tokens) and count them
        off its remaining prompt tokens."""
        if n:
            T = keys.shape[2]
            row.update_and_fetch(keys if n == T else keys[:, :, :n], values if n == T else values[:, :, :n])
        if self._remaining is not None:
            self._remaining[i] -= n

    def keys_and_values(self):
        """Stand-ins (:class:`kvq.cache.CompressedView`) ``[B, H, longest row, D]`` whose attention is this batch's
        (:meth:`attend`, each row over its own tokens), or ``(None, None)`` while no row holds tokens."""
        B, T = self._batch(), self.size()
        if self._packed is not None:
            _, H, Dk, Dv, dtype = self._packed.layout
            return CompressedView((B, H, T, Dk), dtype, self), CompressedView((B, H, T, Dv), dtype, self)
        row = self._last_filled_row()
        if row is None:
            return None, None
        k, v = row.keys_and_values()
        return (CompressedView((B, k.shape[1], T, k.shape[3]), k.dtype, self),
                CompressedView((B, v.shape[1], T, v.shape[3]), v.dtype, self))

    def __deepcopy__(self, memo):
        """A copy of the rows (packed rows are copied unpacked, this batch staying packed: the copy packs again at
        its next decode step)."""
        rows = self._packed.unpack() if self._packed is not None else [copy.deepcopy(r, memo) for r in self._rows]
        new = self.__class__(rows)
        new._remaining = copy.deepcopy(self._remaining, memo)
        new._starts = list(self._starts)
        return new

    def _batch(self) -> int:
        return self._packed.batch if self._packed is not None else len(self._rows)

    def release_chunk(self) -> None:
        """:meth:`KVQCache.release_chunk` for every row (packed rows keep no chunk)."""
        for row in self._rows or ():
            row.release_chunk()

    def attend(self, queries: mx.array, scale: float, mask=None, sink_logits=None) -> mx.array:
        """:meth:`KVQCache.attend` per row, each with its own token positions (``mask`` is not needed: padding is
        never stored); ``[B, H_q, T_q, D_v]``. Packed rows (decode) attend in one call (:meth:`PackedRows.attend`)."""
        if self._packed is not None and queries.shape[2] == 1:
            return self._packed.attend(queries, scale, sink_logits)
        if queries.shape[2] > 1 and sink_logits is None:
            out = self._attend_chunk(queries, scale)
            if out is not None:
                return out
        outs = [row.attend(q, scale, None, sink_logits, query_start=self._starts[i])
                for i, (row, q) in enumerate(zip(self.rows, _rows(queries)))]
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    def _attend_chunk(self, queries: mx.array, scale: float) -> mx.array | None:
        """A prefill chunk of the rows attended in as few calls as stack on a GPU (:func:`kvq.cache.engine.
        attend_rows`): the rows that take the GPU chunk path (:meth:`KVQCache.chunk_rows`), per configuration, stacked
        where their parts do (:mod:`kvq.cache.stacked`: prompts of different lengths included); each stacked row then
        settles (:meth:`KVQCache.chunk_attended`), the others attend alone. ``None`` where no rows stack (each row
        attends alone: the same result)."""
        rows = self.rows
        if len(rows) < 2:
            return None
        T = queries.shape[2]
        chunks = [row.chunk_rows(T, self._starts[i]) for i, row in enumerate(rows)]
        configs = []
        for chunk in chunks:
            if chunk is not None and chunk[1] not in configs:
                configs.append(chunk[1])
        transforms = [None if chunk is None else chunk[2] for chunk in chunks]
        attended, whole = {}, None
        for config in configs:
            offered = [chunk[0] if chunk is not None and chunk[1] == config else None for chunk in chunks]
            if sum(parts is not None for parts in offered) < 2:
                continue
            for group, out in engine.attend_rows(queries, scale, offered, config, transforms):
                whole = out if len(group) == len(rows) else None
                attended.update(zip(group, _rows(out)))
        if not attended:
            return None
        outs = []
        for i, (row, q) in enumerate(zip(rows, _rows(queries))):
            if i in attended:
                outs.append(row.chunk_attended(attended[i], q, scale, None, None, self._starts[i]))
            else:
                outs.append(row.attend(q, scale, None, None, query_start=self._starts[i]))
        if whole is not None and all(out is attended[i] for i, out in enumerate(outs)):
            return whole
        return mx.concatenate(outs, axis=0)

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """Positions are handled per row inside attention; the rows' ``make_mask`` checks ``window_size``
        (:meth:`KVQCache.make_mask` refuses one, :meth:`RotatingKVQCache.make_mask` takes its own ``max_size``)."""
        if self._packed is not None:
            return self._packed.make_mask(N, return_array, window_size)
        return self.rows[0].make_mask(N, return_array, window_size) if self.rows else None

    # -- batching -----------------------------------------------------------------------------------
    @classmethod
    def merge(cls, caches) -> "BatchKVQCache":
        """A batch of copies of ``caches`` (single caches or batches), in order."""
        rows = []
        for c in caches:
            rows += c.rows if isinstance(c, BatchKVQCache) else [c]
        return cls([copy.deepcopy(r) for r in rows])

    def extract(self, idx: int):
        """A copy of row ``idx`` as a single-sequence :class:`KVQCache` (packed rows stay packed)."""
        if self._packed is not None:
            return self._packed.row(idx)
        return copy.deepcopy(self.rows[idx])

    def filter(self, batch_indices) -> None:
        """Keep only the rows at ``batch_indices`` (in that order)."""
        indices = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        self._starts = [self._starts[i] for i in indices]
        if self._packed is not None:
            if indices:
                self._packed.filter(indices)
            else:
                self.rows = []
            return
        self.rows = [self.rows[i] for i in indices]

    def extend(self, other: "BatchKVQCache") -> None:
        """Append ``other``'s rows (packed rows stay packed where ``other``'s rows pack with them)."""
        if self._packed is not None:
            theirs = other._packed or PackedRows.pack(other._rows, minimum=1, template=self._packed)
            if theirs is not None and self._packed.extend(theirs):
                self._starts += other._starts
                return
        self.rows += other.rows
        self._starts += other._starts

    # -- cache protocol -------------------------------------------------------------------------------
    def size(self) -> int:
        if self._packed is not None:
            return max(self._packed.offsets)
        return max((r.offset for r in self.rows), default=0)

    def empty(self) -> bool:
        if self._packed is not None:
            return False
        return all(r.empty() for r in self.rows)

    def is_trimmable(self) -> bool:
        """Whether every row is (a rotating row stops being once tokens have left its window)."""
        return all(r.is_trimmable() for r in self.rows)

    def trim(self, n: int) -> int:
        return max((r.trim(n) for r in self.rows), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes allocated (resident) by all rows, packed or not."""
        if self._packed is not None:
            return self._packed.nbytes
        return sum(r.nbytes for r in self.rows)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "BatchKVQCache":
        """mlx-lm's ``kv_bits`` hook: this batch itself where every row already holds what ``kv_bits`` asks for.

        :raises ValueError: as :meth:`KVQCache.to_quantized` (kvq caches are not quantized a second time).
        """
        for row in self.rows:
            row.to_quantized(group_size, bits)
        return self

    # -- keys/values: only for mlx-lm's pipeline parallelism (issue #10; see KVQCache.keys) ------------
    def _last_filled_row(self):
        """The last row holding tokens (its arrays are part of :attr:`state`), or None."""
        return next((r for r in reversed(self.rows) if not r.empty()), None)

    @property
    def keys(self):
        """Not the keys: :attr:`KVQCache.keys` (one stored array, for ``mx.depends``) of the last row holding
        tokens (``None`` if none does)."""
        row = self._last_filled_row()
        return None if row is None else row.keys

    @keys.setter
    def keys(self, value) -> None:
        """Assign that row's ``keys`` (same rules as :attr:`KVQCache.keys`; ``None`` when no row holds tokens)."""
        self._assign("keys", value)

    @property
    def values(self):
        """Not the values: :attr:`KVQCache.values` of the last row holding tokens (``None`` if none does)."""
        row = self._last_filled_row()
        return None if row is None else row.values

    @values.setter
    def values(self, value) -> None:
        self._assign("values", value)

    def _assign(self, side: str, value) -> None:
        row = self._last_filled_row()
        if row is not None:
            setattr(row, side, value)
        elif value is not None:
            raise ValueError(f"{side}: no row of this batch holds tokens, so only None can be assigned")

    @property
    def state(self) -> dict:
        return {"rows": [r.state for r in self.rows]}

    @classmethod
    def from_state(cls, state: dict) -> "BatchKVQCache":
        """Rebuild a batch from :attr:`state`: each row as a :class:`KVQCache`, or a :class:`RotatingKVQCache` where
        its state has a ``max_size`` (the classes by name: :data:`kvq.cache.state.ROW_CLASSES`)."""
        return cls([ROW_CLASSES["RotatingKVQCache" if "max_size" in s else "KVQCache"].from_state(s)
                    for s in state.get("rows", [])])
