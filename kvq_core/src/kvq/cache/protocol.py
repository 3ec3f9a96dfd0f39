"""What mlx-lm calls on a layer's cache besides storing and attending: size, emptiness, trims (and whether a trim
is exact: :mod:`kvq.cache.reuse`), batching (``merge``), masks, ``kv_bits`` and copies."""

from __future__ import annotations

import copy

import mlx.core as mx

from .prefill import after_chunk
from .reuse import check_trim, trimmable_now
from .views import plain_mask


class CacheProtocol:
    """Mixin of :class:`kvq.cache.KVQCache`: mlx-lm's cache protocol over its ``offset``, ``config``, ``sinks``,
    ``window`` and compressed stores (a subclass overrides what differs: :class:`kvq.cache.RotatingKVQCache`)."""

    def __deepcopy__(self, memo):
        """A copy that shares nothing mutable (``mx.Dtype`` cannot be pickled, so every one the cache's tuples hold
        is passed through: a cache loaded from a file and then updated held two distinct dtype objects, and its
        copy, which mlx-lm's server makes of every cache it reuses, raised ``cannot pickle 'Dtype' object``). A chunk's
        first compression is settled first (:meth:`kvq.cache.KVQCache.settle`)."""
        self.settle()
        for value in self.__dict__.values():
            if type(value) is tuple:
                for item in value:
                    if isinstance(item, mx.Dtype):
                        memo[id(item)] = item
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        # the decode binding holds launch state (split counters of the next step): a copy binds its own
        new.__dict__.update(copy.deepcopy({**self.__dict__, "_bound": None}, memo))
        return new

    def size(self) -> int:
        """Tokens stored."""
        return self.offset

    def empty(self) -> bool:
        """True before the first token is stored."""
        return self.offset == 0

    def is_trimmable(self) -> bool:
        """Whether :meth:`trim` removes tokens: always, except inside :func:`kvq.cache.reuse.untrimmable` (mlx-lm's
        prompt cache deciding which stored entries to keep and reuse)."""
        return trimmable_now()

    def trims_exactly(self, n: int) -> bool:
        """Whether :meth:`trim` of ``n`` tokens leaves exactly what a fresh cache fed the remaining tokens holds
        (the same tokens compressed, the same uncompressed), so that what follows attends as in a run that never
        saw the trimmed tokens. ``False`` where a window flush since the remaining tokens compressed some that a
        fresh run would still hold uncompressed: their 16-bit copies are gone. mlx-lm's server recomputes
        instead of reusing such a trim (:mod:`kvq.cache.reuse`)."""
        n = max(0, min(n, self.offset))
        remaining = self.offset - n
        non_sinks = remaining - min(remaining, self.config.sinks)
        fresh = self._leaving(0, non_sinks)  # what a token-by-token run of the remaining tokens compressed
        kept = self.compressed_keys.length - max(0, n - self.window.length)
        if kept <= 0 and self.compressed_keys.length:
            # every compressed token goes, but what the first compression fitted from them stays (centring, an
            # outlier layer's 8 bits, data-chosen channels): a fresh run would fit those from its own tokens
            return False
        return max(0, kept) == fresh

    def trim(self, n: int) -> int:
        """Forget the newest ``n`` tokens; returns how many were removed.

        Tokens are removed from the window first, then from the compressed store (exactly: encodings are per
        token), then from the sinks. Tokens left behind keep the form they had: where a window flush came after
        the remaining tokens (:meth:`trims_exactly` is ``False``), some of them stay compressed that a fresh run
        would hold uncompressed. Inside :func:`kvq.cache.reuse.exact_trims` (mlx-lm's prompt-cache reuse) such a
        trim raises :class:`kvq.cache.reuse.InexactTrim` and changes nothing.
        """
        self.settle()
        check_trim(self, n)
        n = max(0, min(n, self.offset))
        left = n - self.window.trim(n)
        if left:
            self.compressed_values.trim(left)
            left -= self.compressed_keys.trim(left)
        self.sinks.trim(left)
        self.offset -= n
        if self.offset == 0:
            self.__init__(self.config)  # a fresh cache accepts a new layout
            self._fitted = False  # and fits its mean and scales again from its next first block
        return n

    @classmethod
    def merge(cls, caches):
        """mlx-lm's batching hook: a :class:`BatchKVQCache` of copies of ``caches``."""
        from .batch import BatchKVQCache

        return BatchKVQCache.merge(caches)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """mlx-lm's mask hook (:func:`kvq.cache.views.plain_mask`): kvq enforces causality from positions, so only
        sliding windows are refused (a sliding-window layer gets a :class:`kvq.cache.RotatingKVQCache`). mlx-lm's
        models call it once per forward pass, before their layers: the last pass's shared masks are dropped then
        (:func:`kvq.cache.prefill.after_chunk`)."""
        after_chunk()
        return plain_mask(N, window_size)

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """mlx-lm's ``kv_bits`` hook (``generate``, ``stream_generate`` and ``generate_step`` with ``kv_bits=``; the
        ``--kv-bits`` of its CLI and server): once a cache holds ``quantized_kv_start`` tokens (mlx-lm's default:
        5000), mlx-lm calls this after every model call and goes on with the cache it returns.

        A kvq cache is compressed already, so ``kv_bits`` can only ask for what it holds: when keys and values both
        use kvq's ``affine`` method with these ``bits`` and ``group_size`` (what mlx-lm's ``QuantizedKVCache`` stores,
        with kvq's sinks and window kept in 16 bits), this returns the cache itself. Anything else is refused, not
        converted: quantizing tokens that kvq compressed loses accuracy twice and silently replaces the method the
        user chose; ignoring ``kv_bits`` would hide that it has no effect. (mlx-lm likewise refuses a ``--kv-bits``
        that differs from the bits of a quantized cache it loads.)

        :raises ValueError: naming this cache's methods and the two ways out: leave ``kv_bits`` out, or make kvq
            caches of ``affine`` with these bits and group size.
        """
        head_dims = (None, None) if self._layout is None else self._layout[2:4]
        if self.config.holds_kv_bits(bits, group_size, head_dims):
            return self
        kp, vp = self.config.key_params, self.config.value_params
        raise ValueError(
            f"kv_bits={bits} (kv_group_size={group_size}) asks mlx-lm to quantize a kvq cache that already "
            f"compresses its keys with {kp!r} and its values with {vp!r}; kvq does not quantize compressed tokens a "
            f"second time. Leave kv_bits out to keep kvq's compression, or make kvq caches that hold what kv_bits "
            f"asks for, which it then accepts: kvq.patch_model(model, 'affine', bits={bits}, "
            f"group_size={group_size}) (or kvq.make_prompt_cache with the same arguments)")
