"""Compressed tokens of one layer: the fields of an :class:`kvq.Encoded`, preallocated in steps."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..encoded import Encoded


def snapshot(objects) -> list[dict]:
    """The attributes of ``objects`` (a cache and its stores), with new handles on every array (stores update their
    arrays in place with slice assignments; a handle made before keeps the old contents). Lazy: nothing is copied
    unless :func:`restore` puts them back and they are evaluated."""
    def keep(value):
        if isinstance(value, mx.array):
            return mx.array(value)
        if isinstance(value, dict):
            return {k: keep(v) for k, v in value.items()}
        return value

    return [{k: keep(v) for k, v in vars(obj).items()} for obj in objects]


def restore(objects, saved: list[dict]) -> None:
    """Put back the attributes :func:`snapshot` took of ``objects`` (a failed update leaves the cache as it was)."""
    for obj, attributes in zip(objects, saved):
        vars(obj).clear()
        vars(obj).update(attributes)


#: Tokens a store holds from which a growth also leaves the next flush's room (:func:`spare`).
SPARE_FROM = 4096


def spare(held: int, flush: int) -> int:
    """Tokens of room a store of ``held`` tokens leaves after the ones a growth is for: ``flush`` (the next flush's)
    from :data:`SPARE_FROM` tokens, else none.

    Room the next flush would need within a few decode steps anyway, taken in the growth a compression makes
    anyway: otherwise, after a prefill whose window is nearly full, every layer grows in the first decode steps
    together (issue #52: 48 sequences of 32K on an H100, turboquant:3, 7.8 GB above the caches in those steps,
    2.2 GB with the room left). Below :data:`SPARE_FROM` tokens those copies are small and the room a visible share
    of the cache (a 256-token step more at 2K), so none is left."""
    return flush if held >= SPARE_FROM else 0


class _Trimmable:
    """Holds ``length`` tokens at the front of its arrays; trimming only moves that mark."""

    length = 0

    def trim(self, n: int) -> int:
        """Forget the newest ``n`` tokens (exact: everything is stored per token); returns how many."""
        n = min(n, self.length)
        self.length -= n
        return n


def write_fields(data: dict[str, mx.array], encoded: Encoded, slot: int) -> None:
    """Write ``encoded``'s tokens into every field of ``data`` at slots ``slot ...`` along axis 2 (a slice
    assignment per field). A block that covers a whole field is copied first: a slice assignment covering a whole
    array would alias its source (and keep alive the larger array it may be a slice of); a partial one writes into
    the field, so a window flush costs one operation per field, not two.

    MLX writes in place only into a buffer nothing else holds: any other array over a field's buffer (a slice
    kept as a view, a bound decode step's arguments, a kernel still running on the device) turns the write into a
    copy of the whole field, so callers drop their views first."""
    n = encoded.num_tokens
    for name, array in encoded.data.items():
        field = data[name]
        if n == field.shape[2]:
            array = mx.array(array)
        field[:, :, slot : slot + n] = array


class EncodedStore(_Trimmable):
    """An append-only (and trimmable) store of encoded tokens along axis 2.

    Capacity grows in whole steps of ``step`` tokens: every field gets one concatenation per growth (the held
    tokens, those being appended where an append grows it, and a zero block), never one per token (the pattern of
    mlx-lm's ``KVCache``). An append that fits writes into the preallocated space with a slice assignment.

    :param step: tokens per growth step.
    """

    def __init__(self, step: int = 256) -> None:
        self.step = step
        self.data: dict[str, mx.array] | None = None
        self.params: Any = None
        self.head_dim = 0
        self.length = 0
        self._view: Encoded | None = None  # view() of the current tokens; every change clears it

    @property
    def capacity(self) -> int:
        """Tokens the allocated arrays can hold."""
        return 0 if self.data is None else next(iter(self.data.values())).shape[2]

    def append(self, encoded: Encoded, spare: int = 0) -> None:
        """Store ``encoded``'s tokens after the current ones.

        :param spare: tokens of room to leave after them: the store grows (one copy) where they and this room do
            not fit (:class:`kvq.cache.KVQCache` passes a flush's worth for a prefill chunk, :func:`spare`).
        :raises ValueError: ``encoded`` has other fields, params or head_dim than what is stored.
        """
        n = encoded.num_tokens
        if self.data is not None and (set(encoded.data) != set(self.data) or encoded.params != self.params):
            raise ValueError(f"encoded: fields/params {sorted(encoded.data)} {encoded.params!r} differ from the "
                             f"stored {sorted(self.data)} {self.params!r}")
        self._view = None  # first: a view (slices sharing the fields' buffers) would make the write a copy
        if self.length + n + spare > self.capacity:
            self.params, self.head_dim = encoded.params, encoded.head_dim
            self._grow(self.length + n + spare, encoded)  # the tokens written in the same copy
        else:
            write_fields(self.data, encoded, self.length)
        self.length += n

    def replace_field(self, name: str, array: mx.array) -> None:
        """Hold ``array`` as field ``name`` (an array of the same shape and dtype, such as ``mx.depends`` of the
        field: :attr:`kvq.cache.KVQCache.keys`); the cached view is dropped, so views read the new array."""
        self.data[name] = array
        self._view = None

    def __getstate__(self) -> dict:
        """Copies (``copy.deepcopy`` of a cache) leave out the cached view: it would copy the tokens again."""
        return {**self.__dict__, "_view": None}

    def trim(self, n: int) -> int:
        """Forget the newest ``n`` tokens (see :class:`_Trimmable`)."""
        self._view = None
        return super().trim(n)

    def reserve(self, tokens: int) -> None:
        """Capacity for at least ``tokens`` tokens now (whole steps, the held ones kept), rather than at the
        :meth:`append` that needs it; nothing happens when the store is empty or already holds room.

        Growing copies every field once (a concatenation). On CUDA, MLX keeps a kernel's inputs alive until the
        command buffer that ran it has completed, so when every layer grew in the same decode step the replaced
        arrays of several layers were alive at once (issue #52: about five layers of the store above the caches at
        32K); :class:`kvq.cache.KVQCache` calls this on a step of its own per layer (:meth:`KVQCache._grow_ahead`).
        """
        if self.data is not None and tokens > self.capacity:
            self._grow(tokens)

    def _grow(self, needed: int, encoded: Encoded | None = None) -> None:
        """Capacity for ``needed`` tokens: per field, the held tokens, then ``encoded``'s tokens where given (an
        append that grows writes them in the same concatenation rather than in a slice assignment after it: one
        node fewer per field, for a prefill chunk per layer), then whole steps of zeros shaped like the field
        (``encoded``'s where given, else the held one's). The steps count from the held tokens, not the old
        capacity: the two differ wherever the store had room left (after a trim, or a chunk shorter than the last
        one's slack), and counting from the capacity left a store too small for the block being appended (the write
        raised: a chunk of 384 compressed tokens after one of 387, at step 16)."""
        held = 0 if self.data is None else self.length
        steps = -(-(needed - held) // self.step)
        new = 0 if encoded is None else encoded.num_tokens
        grown = {}
        for name, array in (self.data if encoded is None else encoded.data).items():
            pieces = [] if self.data is None else [self.data[name][:, :, : self.length]]
            if encoded is not None:
                pieces.append(encoded.data[name])
            shape = list(array.shape)
            shape[2] = steps * self.step - new
            if shape[2] > 0 or not pieces:
                pieces.append(mx.zeros(shape, array.dtype))
            # one piece alone is copied: the field must not alias an array it came from (write_fields)
            grown[name] = mx.concatenate(pieces, axis=2) if len(pieces) > 1 else mx.array(pieces[0])
        self.data = grown
        self._view = None

    def view(self) -> Encoded | None:
        """The stored tokens as one :class:`Encoded` (views of the arrays, no copy); ``None`` if empty."""
        if self.data is None or self.length == 0:
            return None
        if self._view is None:  # made once per change: decode steps between flushes reuse it
            self._view = Encoded(self.params, {k: v[:, :, : self.length] for k, v in self.data.items()},
                                 self.head_dim)
        return self._view

    @property
    def nbytes(self) -> int:
        """Bytes allocated (resident), including unused preallocated capacity."""
        return 0 if self.data is None else sum(v.nbytes for v in self.data.values())


class DenseBuffer(_Trimmable):
    """Uncompressed keys and values of at most ``capacity`` tokens, in 16-bit arrays this buffer owns.

    float16 and bfloat16 inputs are kept as they are; float32 inputs are stored as float16.

    Writing copies into preallocated arrays, so the buffer never keeps alive a larger array that a slice of
    the caller's input would point into (a prefill chunk, say): ``nbytes`` is what is really resident.

    :param capacity: the most tokens held (the sinks count, or the residual window).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys = self.values = None
        self.length = 0

    def _allocate(self, keys: mx.array, values: mx.array) -> None:
        B, H, _, Dk = keys.shape
        self.keys = mx.zeros((B, H, self.capacity, Dk), keys.dtype)
        self.values = mx.zeros((B, H, self.capacity, values.shape[3]), values.dtype)

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Copy tokens after the held ones. :raises ValueError: more than the capacity."""
        n = keys.shape[2]
        if self.length + n > self.capacity:
            raise ValueError(f"{self.length + n} tokens exceed this buffer's capacity of {self.capacity}")
        if n == 0:
            return
        # uncompressed tokens are kept in 16 bits (docs/DESIGN.md, "The cache"): float32 models (the CPU) are
        # stored as float16
        keys, values = (x.astype(mx.float16) if x.dtype == mx.float32 else x for x in (keys, values))
        if self.keys is None:
            self._allocate(keys, values)
        # mx.array(...) copies: a slice assignment covering the whole buffer would otherwise alias (and keep
        # alive) the array that ``keys`` is a slice of, such as a whole prefill chunk; a partial one copies
        if n == self.capacity:
            keys, values = mx.array(keys), mx.array(values)
        self.keys[:, :, self.length : self.length + n] = keys
        self.values[:, :, self.length : self.length + n] = values
        self.length += n

    def replace(self, keys: mx.array, values: mx.array) -> None:
        """Hold exactly these tokens (a copy)."""
        self.length = 0
        self.append(keys, values)

    def view(self):
        """``(keys, values)`` of the held tokens, or ``(None, None)`` when empty."""
        if self.length == 0:
            return None, None
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    @property
    def nbytes(self) -> int:
        """Bytes allocated."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
