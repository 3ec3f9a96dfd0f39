"""Packed rows: a :class:`kvq.cache.BatchKVQCache`'s sequences in one batched store for decode (issue #22).

A batch of sequences of different lengths decodes in lockstep, one token per row and step. Kept as separate
:class:`kvq.cache.KVQCache` rows, every row costs its own graph operations and its own kernel launch per layer and
step, so a batch of ``B`` decodes about ``B`` times slower on the host than one sequence. :class:`PackedRows` holds
the rows' compressed tokens, sinks and residual windows as ``[B, ...]`` arrays with per-row token counts, so a
decode step is one window write and one attention call for all rows: on CUDA one launch of the tensor-core kernel
that reads each row's counts (:class:`kvq.contract.BindsRaggedDense`), elsewhere the rows' parts attended with masks
that stop each row at its own counts (the same result).

Every row keeps exactly the schedule it has alone: a row's window flushes when *its* window is full, its oldest
``flush`` tokens quantized as a ``[1, H, flush, D]`` block by the same implementations (:func:`kvq.cache.choice.
encode_tokens`), so packing changes no stored code, and a row's attention differs from its own only by the order
of float32 additions. Rows are packed once they are past their prefill (sinks full, some tokens compressed, one
configuration for all) and unpacked back into rows for anything but decode (a prefill chunk, ``extend``, files).

Memory: the packed arrays hold each row's compressed tokens padded to the longest row's count rounded up to the
store's ``step`` (the padding of a batch of unequal rows: ``B * (longest - row)`` tokens' codes), plus one window
buffer ``[B, H, window + flush - 1, D]`` per side, as the rows did. Compute: the ragged kernel reads each row's own
tokens only; the masked parts (the CPU, Metal) score every row over the longest row's compressed tokens, so a batch
of very unequal rows costs up to ``B`` times its rows' attention there (the host work is one call instead of ``B``).
"""

from __future__ import annotations

import mlx.core as mx

import numpy as np

from ..encoded import Encoded
from ..plugins import registry
from . import engine
from .parts import Part
from .centring import KeyTransform, centred, neutral, stacked
from .choice import encode_tokens
from .packable import packable
from .prefill import after_chunk
from .schedule import growth_append
from .store import spare
from .views import plain_mask


#: At most this many rows flushing in one decode step are written with slice updates of their own (a few nodes
#: per row and field); more take one scatter per field (~16 nodes however many rows: issue #52).
SLICED_ROWS = 4

#: What one decode token adds to a row's (compressed, window) counts.
_NEXT_WINDOW_TOKEN = mx.array([[0, 1]], dtype=mx.int32)


def _copy(x):
    """A copy of ``x`` that shares no buffer (a row taken out of a batched array must not keep the batch alive)."""
    return None if x is None else mx.array(x)


def _round_up(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)


def _pad_tokens(array: mx.array, capacity: int) -> mx.array:
    """``array`` ``[B, H, T, ...]`` with zeros after its ``T`` tokens up to ``capacity``."""
    if array.shape[2] >= capacity:
        return array
    pad = [(0, 0)] * array.ndim
    pad[2] = (0, capacity - array.shape[2])
    return mx.pad(array, pad)


class PackedRows:
    """The rows of a :class:`kvq.cache.BatchKVQCache` in one batched store; build it with :meth:`pack`.

    Attributes: ``offsets`` (tokens per row), ``compressed`` (tokens compressed per row), ``window_lengths``
    (window tokens per row), all Python lists of ``B`` ints.
    """

    def __init__(self, rows: list, template: "PackedRows | None" = None) -> None:
        """Use :meth:`pack`. ``template``: packed rows whose configuration, parameters and fields these rows take
        (rows that have all compressed nothing yet)."""
        first = rows[0]
        ref = next((r for r in rows if r.compressed_keys.length), None)
        #: the rows' class: :meth:`row` rebuilds rows with its public :meth:`kvq.cache.KVQCache.restore`
        self.row_class = type(first)
        self.config = template.config if template is not None else ref.config
        self._flush = first.config.flush_tokens
        self.layout = (len(rows), *first.layout[1:])
        self.offsets = [r.offset for r in rows]
        self.compressed = [r.compressed_keys.length for r in rows]
        self.window_lengths = [r.window.length for r in rows]
        #: per row: its own configuration while it has compressed nothing (its first compression fits it), else None
        self.fresh = [None if r.compressed_keys.length else r.config for r in rows]
        self.step = first.compressed_keys.step
        if template is not None:
            self.params, self.head_dims = list(template.params), list(template.head_dims)
            like = [{k: (v.shape[3:], v.dtype) for k, v in side.items()} for side in template.sides]
        else:
            self.params = [ref.compressed_keys.params, ref.compressed_values.params]
            self.head_dims = [ref.compressed_keys.head_dim, ref.compressed_values.head_dim]
            like = [{k: (v.shape[3:], v.dtype) for k, v in store.data.items()}
                    for store in (ref.compressed_keys, ref.compressed_values)]
        most = max(self.compressed)  # with the next flush's room, as the rows' own stores leave it (store.spare)
        capacity = _round_up(most + spare(most, self._flush), self.step)
        H = self.layout[1]
        self.sides = [self._pack_store([r.compressed_keys for r in rows], capacity, like[0], H),
                      self._pack_store([r.compressed_values for r in rows], capacity, like[1], H)]
        cat = (lambda xs: mx.concatenate(xs, axis=0))
        self.sink_keys = cat([r.sinks.keys for r in rows]) if self.config.sinks else None
        self.sink_values = cat([r.sinks.values for r in rows]) if self.config.sinks else None
        self.window_keys = cat([r.window.keys for r in rows])
        self.window_values = cat([r.window.values for r in rows])
        #: per row: whether its keys are centred, whether scaled (kvq.cache.guard); key_mean holds zeros and key_scale
        #: ones for the rows that are not (no key, score or logit changes), each None when no row is
        self.centred = [r.key_mean is not None for r in rows]
        self.scaled = [r.key_scale is not None for r in rows]
        shape = self.layout[1:3]
        self.transform = KeyTransform(stacked([r.key_mean for r in rows], "mean", shape),
                                      stacked([r.key_scale for r in rows], "scale", shape))
        self._bound = None  # (signature, step) of the fused ragged decode step, or (signature, None)
        self._slot = getattr(first, "_slot", 0)  # spreads the layers' growths over steps (_schedule_growth)
        self._grow_in = 0  # appends until this layer grows ahead of the next flush (0: none due)
        self._lengths = None  # int32 [B, 2] of (compressed, window) counts on the device (lengths())
        self._offset = None  # int32 [B] of the rows' token counts on the device (offset())
        mx.eval(*self._arrays())
        self._schedule_growth()

    @property
    def key_mean(self) -> mx.array | None:
        """The rows' key means, float32 ``[B, H, 1, D_k]`` (zeros for rows that are not centred), or ``None`` where
        no row is centred."""
        return self.transform.mean

    @property
    def key_scale(self) -> mx.array | None:
        """The rows' key scales, float32 ``[B, H, 1, D_k]`` (ones for rows that are not scaled), or ``None`` where
        no row is scaled."""
        return self.transform.scale

    @classmethod
    def pack(cls, rows: list, minimum: int = 2, template: "PackedRows | None" = None) -> "PackedRows | None":
        """The packed form of ``rows`` (:func:`packable` with ``minimum`` and ``template``), evaluated so the rows'
        own arrays can be freed; ``None`` where they cannot be packed. Each row's last chunk is settled first
        (:meth:`kvq.cache.KVQCache.settle`)."""
        for row in rows:
            row.settle()
        if not packable(rows, minimum, template):
            return None
        return cls(rows, template)

    @staticmethod
    def _pack_store(stores: list, capacity: int, like: dict, heads: int) -> dict:
        """The rows' stores as fields ``[B, H, capacity, ...]`` (zeros where a row has no tokens)."""
        fields = {}
        for name, (rest, dtype) in like.items():
            parts = []
            for store in stores:
                if store.length:
                    parts.append(_pad_tokens(store.data[name][:, :, : min(store.capacity, capacity)], capacity))
                else:
                    parts.append(mx.zeros((1, heads, capacity, *rest), dtype))
            fields[name] = mx.concatenate(parts, axis=0)
        return fields

    def _arrays(self) -> list:
        arrays = [*self.sides[0].values(), *self.sides[1].values(), self.window_keys, self.window_values]
        return arrays + [x for x in (self.sink_keys, self.sink_values, self.key_mean, self.key_scale) if x is not None]

    @property
    def batch(self) -> int:
        """Rows (sequences) held."""
        return len(self.offsets)

    @property
    def capacity(self) -> int:
        """Compressed tokens each row's arrays can hold."""
        return next(iter(self.sides[0].values())).shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes allocated (resident)."""
        return sum(a.nbytes for a in self._arrays())

    # -- decode ---------------------------------------------------------------------------------------
    def append(self, keys: mx.array, values: mx.array) -> list | None:
        """Store one decode token per row (``[B, H_kv, 1, D]`` of the rows' layout and dtype), flushing first the
        rows whose window is full (:func:`kvq.cache.schedule.leaving`: a full window of ``window + flush - 1``
        tokens and one more compress their oldest ``flush``).

        A row's first compression is its own :class:`kvq.cache.KVQCache` update (it fits the layer's parameters
        and decides centring and outlier layers from that row's tokens, as alone); its result joins the pack where
        it matches the packed configuration and parameters. Where it does not, the rows can no longer be packed:
        the return value is then every row as a single-sequence cache, the rows of that first compression already
        holding their token, the others not (``(rows, done)``: ``done`` the indices that hold it). ``None``
        otherwise.

        :raises ValueError/TypeError: keys or values that are not one token per row of this layout.
        """
        B, H, Dk, Dv, dtype = self.layout
        if keys.shape != (B, H, 1, Dk) or values.shape != (B, H, 1, Dv) or keys.dtype != values.dtype:
            raise ValueError(f"keys {tuple(keys.shape)} / values {tuple(values.shape)}: packed rows take one token "
                             f"per row, [{B}, {H}, 1, {Dk}] / [{B}, {H}, 1, {Dv}] of one dtype")
        full = self.window_keys.shape[2]
        done = set()
        compressed = False
        if max(self.window_lengths) >= full:  # some row's window is full (else no per-row scan: issue #52)
            compressed = True
            full_rows = [b for b, n in enumerate(self.window_lengths) if n >= full]
            first = [b for b in full_rows if not self.compressed[b]]
            if first:
                unpacked = self._first_compressions(first, keys, values)
                if unpacked is not None:
                    return unpacked, set(first)
            done = set(first)
            flushing = [b for b in full_rows if b not in done]
            if flushing:
                self._flush_rows(flushing)
        if keys.dtype != self.window_keys.dtype:
            keys, values = keys.astype(self.window_keys.dtype), values.astype(self.window_values.dtype)
        lengths = self.window_lengths
        n = lengths[0]
        if not done and all(m == n for m in lengths):
            self.window_keys[:, :, n : n + 1] = keys
            self.window_values[:, :, n : n + 1] = values
        elif not done:  # each row's token at its own window count, read on the device (no per-row host list):
            # one scatter along the token axis a side, the slots [B, 1, 1, 1] broadcast over heads and channels
            # (an advanced-index assignment builds ~16 graph nodes a side here, issue #52)
            slots = self.lengths()[:, 1:].reshape(B, 1, 1, 1)
            self.window_keys = mx.put_along_axis(self.window_keys, slots, keys, axis=2)
            self.window_values = mx.put_along_axis(self.window_values, slots, values, axis=2)
        elif len(done) < B:  # every row in done (each made its first compression this step): nothing to write
            rest = [b for b in range(B) if b not in done]
            rows, slots = mx.array(rest), mx.array([lengths[b] for b in rest])
            self.window_keys[rows, :, slots] = mx.take(keys, rows, axis=0)[:, :, 0]
            self.window_values[rows, :, slots] = mx.take(values, rows, axis=0)[:, :, 0]
        self.window_lengths = [n + (b not in done) for b, n in enumerate(lengths)]
        self.offsets = [n + (b not in done) for b, n in enumerate(self.offsets)]
        # the per-row counts on the device, advanced by one device operation each (moved by a flush, rebuilt after
        # a change of rows)
        if self._lengths is not None:
            self._lengths = self._lengths + _NEXT_WINDOW_TOKEN
        if self._offset is not None:
            self._offset = self._offset + 1
        if self._grow_in:
            self._grow_in -= 1
            if not self._grow_in and max(self.compressed) + self._flush > self.capacity:
                self._grow(max(self.compressed) + self._flush)
        if compressed and not self._grow_in:
            self._schedule_growth()
        return None

    def _schedule_growth(self) -> None:
        """Where a row's next flush will not fit the capacity, pick the append that grows the arrays before it,
        among those that come before the first such row's flush (:func:`kvq.cache.schedule.growth_append`, the
        rule of :meth:`kvq.cache.KVQCache._schedule_growth` for one sequence). A row whose window is full leaves no
        such append: its flush grows the arrays."""
        self._grow_in = 0
        full, f, capacity = self.window_keys.shape[2], self._flush, self.capacity
        need = [b for b, c in enumerate(self.compressed) if c + f > capacity]
        if need:
            self._grow_in = growth_append(min(full - self.window_lengths[b] for b in need), self._slot)

    def _first_compressions(self, rows: list, keys: mx.array, values: mx.array) -> list | None:
        """The decode token of each of ``rows`` (full windows, nothing compressed yet) stored by that row alone
        (:meth:`kvq.cache.KVQCache.update_and_fetch`: its first compression); rows whose configuration and
        parameters come out as the pack's are put back (:meth:`_put_row`). ``None``, or every row unpacked when one
        does not match (see :meth:`append`)."""
        mismatched = {}
        for b in rows:
            row = self.row(b)
            row.update_and_fetch(keys[b : b + 1], values[b : b + 1])
            if row.config == self.config and [row.compressed_keys.params, row.compressed_values.params] == self.params:
                self._put_row(b, row)
            else:
                mismatched[b] = row
        if not mismatched:
            return None
        return [mismatched[b] if b in mismatched else self.row(b) for b in range(self.batch)]

    def _put_row(self, b: int, row) -> None:
        """Hold ``row`` (a single-sequence cache of the pack's configuration and parameters) as row ``b``."""
        n = row.compressed_keys.length
        if n > self.capacity:
            self._grow(n)
        for side, store in zip(self.sides, (row.compressed_keys, row.compressed_values)):
            for name, array in store.data.items():
                side[name][b : b + 1, :, :n] = array[:, :, :n]
        w = row.window.length
        self.window_keys[b : b + 1, :, :w] = row.window.keys[:, :, :w]
        self.window_values[b : b + 1, :, :w] = row.window.values[:, :, :w]
        self.compressed[b], self.window_lengths[b], self.offsets[b], self.fresh[b] = n, w, row.offset, None
        if row.key_mean is not None or row.key_scale is not None:
            new = []
            for name, mine, theirs in (("mean", self.key_mean, row.key_mean), ("scale", self.key_scale, row.key_scale)):
                if theirs is not None:
                    mine = neutral(name, self.batch, self.layout[1:3]) if mine is None else mine
                    mine[b : b + 1] = theirs
                new.append(mine)
            self.transform.set(*new)
            self.centred[b] = row.key_mean is not None
            self.scaled[b] = row.key_scale is not None
        self._bound = self._lengths = self._offset = None

    def _grow(self, needed: int) -> None:
        """Room for ``needed`` compressed tokens in every row (whole steps of zeros)."""
        grow = _round_up(needed - self.capacity, self.step)
        for side in self.sides:
            for name, array in side.items():
                shape = list(array.shape)
                shape[2] = grow
                side[name] = mx.concatenate([array, mx.zeros(shape, array.dtype)], axis=2)
        self._bound = None

    def _flush_rows(self, rows: list) -> None:
        """Compress the oldest ``flush`` window tokens of the full-window ``rows`` into their compressed tokens, as
        each row alone would: one encoding call for these rows (``[len(rows), H, flush, D]``; quantizers encode
        every token on its own), then the writes (issue #52: no per-row host work in a decode step): whole-batch
        slice updates where every row flushes at the same count; a slice update per row and field where at most
        :data:`SLICED_ROWS` rows flush (rows of different lengths flush on different steps, mostly one at a time);
        otherwise one scatter per code field and one per window buffer."""
        f, full = self._flush, self.window_keys.shape[2]
        every = len(rows) == self.batch
        sliced = not every and len(rows) <= SLICED_ROWS
        one = sliced and len(rows) == 1
        index = None if every or one else mx.array(rows)  # the flushing rows' gathers and scatters
        if every:
            pick = (lambda x: x)
        elif one:  # a view of the row, no gather
            pick = (lambda x, b=rows[0]: x[b : b + 1])
        else:
            pick = (lambda x: mx.take(x, index, axis=0))
        keys, values = pick(self.window_keys[:, :, :f]), pick(self.window_values[:, :, :f])
        mean = None if self.key_mean is None else pick(self.key_mean)
        inverse = None if self.key_scale is None else pick(self.transform.inverse)
        encoded = encode_tokens(self.config, centred(keys, mean, inverse), values)
        counts = [self.compressed[b] for b in rows]
        needed = max(counts) + f
        if needed > self.capacity:  # with the next flush's room (store.spare)
            self._grow(needed + spare(needed, f))
        same = every and all(c == counts[0] for c in counts)
        if not same and not sliced:  # each row's codes go to its own count: one scatter per field
            row_index = (mx.arange(self.batch) if index is None else index)[:, None]
            positions = mx.array(counts)[:, None] + mx.arange(f)[None]
        for side, enc in zip(self.sides, encoded):
            for name, array in enc.data.items():
                if same:
                    side[name][:, :, counts[0] : counts[0] + f] = array
                elif sliced:
                    for i, (b, c) in enumerate(zip(rows, counts)):
                        side[name][b : b + 1, :, c : c + f] = array[i : i + 1]
                else:  # [n, H, f, W] written at [n, f] (advanced indices first, then the heads and words)
                    side[name][row_index, :, positions] = mx.swapaxes(array, 1, 2)
        # the tokens that stay move to the front (a new array: a slice assignment from the same buffer could
        # overlap its own source)
        for buffer in (self.window_keys, self.window_values):
            if every:
                buffer[:, :, : full - f] = mx.array(buffer[:, :, f:full])
            elif sliced:
                for b in rows:
                    buffer[b : b + 1, :, : full - f] = mx.array(buffer[b : b + 1, :, f:full])
            else:
                buffer[index, :, : full - f] = pick(buffer)[:, :, f:full]
        for b in rows:
            self.compressed[b] += f
            self.window_lengths[b] = full - f
        # a bound step that reads the code arrays it holds at each call (written in place above; :meth:`_grow`
        # replaces them and binds again) is kept; any other binds again. The counts on the device move by
        # (+flush, -flush) for these rows
        if self._bound is not None and not getattr(self._bound[1], "reads_in_place", False):
            self._bound = None
        if self._lengths is not None:
            delta = mx.array([[f, -f]], dtype=mx.int32)
            if every:
                self._lengths = self._lengths + delta
            else:
                self._lengths = self._lengths.at[mx.array(rows) if index is None else index].add(delta)

    def _encoded(self, side: int, tokens: int) -> Encoded:
        """The rows' compressed tokens of ``side`` (0 keys, 1 values) up to ``tokens``; at the capacity, the
        stored arrays themselves (what a bound step holds: a flush writes into them in place)."""
        data = self.sides[side]
        if tokens != self.capacity:
            data = {k: v[:, :, :tokens] for k, v in data.items()}
        return Encoded(self.params[side], dict(data), self.head_dims[side])

    def lengths(self) -> mx.array:
        """int32 ``[B, 2]``: each row's compressed and window token counts (on the device: made from the counts
        after a flush, then advanced by :meth:`append`)."""
        if self._lengths is None:
            self._lengths = mx.array([[c, w] for c, w in zip(self.compressed, self.window_lengths)], dtype=mx.int32)
        return self._lengths

    def offset(self) -> mx.array:
        """int32 ``[B]``: each row's tokens (mlx-lm's RoPE offsets; on the device, advanced by :meth:`append`)."""
        if self._offset is None:
            self._offset = mx.array(self.offsets, dtype=mx.int32)
        return self._offset

    def attend(self, queries: mx.array, scale: float, sink_logits: mx.array | None = None) -> mx.array:
        """Attention of one decode query per row (``[B, H_q, 1, D]``, the newest token of each row) over each row's
        own tokens: ``[B, H_q, 1, D_v]`` in the queries' dtype. The fused ragged step where the implementation
        binds one (:class:`kvq.contract.BindsRaggedDense`), else every part with each row's counts as masks.
        """
        after_chunk()  # a decode step: the last chunk's shared mask is no longer needed
        if sink_logits is None:
            step = self._step(queries, scale)
            if step is not None:
                transform = self.transform
                return step(transform.queries(queries), transform.centred_dense(self.window_keys), self.window_values,
                            self.lengths())
        return self._attend_parts(queries, scale, sink_logits)

    def _step(self, queries, scale):
        signature = (queries.shape, queries.dtype, scale, registry().generation)
        bound = self._bound
        if bound is None or bound[0] != signature:
            bound = self._bound = (signature, self._bind(queries, scale))
        return bound[1]

    def _bind(self, queries, scale):
        keys, values = self._encoded(0, self.capacity), self._encoded(1, self.capacity)
        return engine.bind_ragged(self.config, self.transform.queries(queries), scale, keys, values,
                                  self.transform.centred_dense(self.sink_keys),
                                  self.sink_values, self.window_keys, self.window_values)

    def _attend_parts(self, queries, scale, sink_logits):
        """Every part attended on its own and merged by the engine (:func:`kvq.cache.engine.attend`): the sinks
        whole, the compressed tokens and the window up to each row's own counts (per batch row intervals), the
        compressed part's log-sum-exp given back the mean's logits (as a single row's parts; the fused step scores
        everything centred instead)."""
        rows = np.zeros((self.batch, 1), np.int64)
        parts = []
        if self.sink_keys is not None:
            parts.append(Part(self.sink_keys, self.sink_values, False))
        longest = max(self.compressed)
        if longest:  # rows kept by a filter may all have compressed nothing yet
            parts.append(Part(self._encoded(0, longest), self._encoded(1, longest), True, 0, rows,
                                     np.array(self.compressed)[:, None]))
        parts.append(Part(self.window_keys, self.window_values, False, 0, rows,
                                 np.array(self.window_lengths)[:, None]))
        return engine.attend(queries, scale, parts, self.config, self.transform, sink_logits=sink_logits)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """mlx-lm's mask hook for the packed rows (:func:`kvq.cache.views.plain_mask`)."""
        return plain_mask(N, window_size)

    # -- rows -----------------------------------------------------------------------------------------
    def filter(self, indices: list) -> None:
        """Keep only the rows at ``indices`` (in that order)."""
        take = mx.array(indices)
        for side in self.sides:
            for name in side:
                side[name] = mx.take(side[name], take, axis=0)
        for name in ("sink_keys", "sink_values", "window_keys", "window_values"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, mx.take(value, take, axis=0))
        if self.transform.active:
            self.transform.set(*(None if x is None else mx.take(x, take, axis=0) for x in (self.key_mean, self.key_scale)))
        for name in ("offsets", "compressed", "window_lengths", "fresh", "centred", "scaled"):
            setattr(self, name, [getattr(self, name)[i] for i in indices])
        self.layout = (len(indices), *self.layout[1:])
        self._bound = self._lengths = self._offset = None
        self._schedule_growth()

    def extend(self, other: "PackedRows") -> bool:
        """Append ``other``'s rows (packed rows of the same configuration and layout), padding the shorter side's
        compressed tokens to a common capacity; ``False``, with nothing changed, where they do not match."""
        if (other.config != self.config or other._flush != self._flush or other.layout[1:] != self.layout[1:]
                or other.params != self.params or other.step != self.step
                or (other.sink_keys is None) != (self.sink_keys is None)
                or set(other.sides[0]) != set(self.sides[0]) or set(other.sides[1]) != set(self.sides[1])):
            return False
        capacity = max(self.capacity, other.capacity)
        for mine, theirs in zip(self.sides, other.sides):
            for name in mine:
                mine[name] = mx.concatenate([_pad_tokens(mine[name], capacity), _pad_tokens(theirs[name], capacity)])
        for name in ("sink_keys", "sink_values", "window_keys", "window_values"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, mx.concatenate([value, getattr(other, name)]))
        if self.transform.active or other.transform.active:
            def joined(name, mine, theirs):
                if mine is None and theirs is None:
                    return None
                fill = (lambda p: neutral(name, p.batch, p.layout[1:3]))
                return mx.concatenate([fill(self) if mine is None else mine, fill(other) if theirs is None else theirs])

            self.transform.set(joined("mean", self.key_mean, other.key_mean),
                               joined("scale", self.key_scale, other.key_scale))
        for name in ("offsets", "compressed", "window_lengths", "fresh", "centred", "scaled"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.layout = (self.batch, *self.layout[1:])
        self._bound = self._lengths = self._offset = None
        self._schedule_growth()  # the new rows may need room before the old countdown ends
        return True

    def row(self, b: int):
        """Row ``b`` as a single-sequence cache of the rows' class (a copy: it keeps none of these arrays alive),
        equal to the row this was packed from after the same updates (:meth:`kvq.cache.KVQCache.restore`)."""
        n = self.compressed[b]
        compressed = None
        if n:  # a row that has compressed nothing keeps an empty store (its first compression fits it)
            compressed = tuple(Encoded(params, {k: v[b : b + 1, :, :n] for k, v in side.items()}, head_dim)
                               for side, params, head_dim in zip(self.sides, self.params, self.head_dims))
        sinks = None
        if self.sink_keys is not None:
            sinks = (self.sink_keys[b : b + 1], self.sink_values[b : b + 1])
        w = self.window_lengths[b]
        window = (self.window_keys[b : b + 1, :, :w], self.window_values[b : b + 1, :, :w]) if w else None
        mean = _copy(self.key_mean[b : b + 1]) if self.centred[b] else None
        key_scale = _copy(self.key_scale[b : b + 1]) if self.scaled[b] else None
        row = self.row_class.restore(self.fresh[b] or self.config, (1, *self.layout[1:]), self.offsets[b],
                                     sinks=sinks, window=window, compressed=compressed, key_mean=mean,
                                     key_scale=key_scale)
        row._slot = self._slot + b  # the layer's place among the layers (a repack spreads growths as before)
        return row

    def unpack(self) -> list:
        """Every row as :meth:`row` gives it."""
        return [self.row(b) for b in range(self.batch)]


__all__ = ["PackedRows"]
