"""``KVQCache``: one layer's KV cache for mlx-lm that stores compressed keys and values.

Layout along the token axis: sinks (the first ``sinks`` tokens, uncompressed) | compressed tokens (the
methods' :class:`kvq.Encoded` form, in an :class:`EncodedStore`) | residual window (the most recent
``window`` tokens, uncompressed). Tokens leave the window for the compressed store in blocks of ``flush``
(:mod:`kvq.cache.schedule`). Attention describes these parts and what each query row sees of them, and the attention
engine (:mod:`kvq.cache.engine`) attends and merges them with log-sum-exp, so no fp16 copy of compressed tokens is
made.

The layer's seams live beside it: its configuration (:mod:`~kvq.cache.config`), which implementation serves each op
(:mod:`~kvq.cache.choice`), centred and scaled keys (:mod:`~kvq.cache.centring`), the window's schedule
(:mod:`~kvq.cache.schedule`), the stand-ins handed to models (:mod:`~kvq.cache.views`), the ``keys``/``values``
of pipeline parallelism (:mod:`~kvq.cache.depends`) and prompt-cache files (:mod:`~kvq.cache.state`).

Sinks and window follow StreamingLLM (Xiao et al., arXiv 2309.17453) and KIVI's residual (arXiv 2402.02750).
"""

from __future__ import annotations

import itertools

import attrs
import mlx.core as mx
import numpy as np

from ..contract import Fits, optional_hook
from ..encoded import Encoded
from ..plugins import implemented_ops, registry
from ..validate import float_array
from . import engine
from .parts import Part, causal
from .centring import KeyTransform
from .choice import dequantize, encode_tokens
from .config import CacheConfig
from .depends import DependencySlots
from .guard import decide_ahead, guard_layer, settle
from .schedule import Fresh, growth_append, leaving, most_held, visible
from .persist import PromptCacheState
from .prefill import after_chunk
from .protocol import CacheProtocol
from .state import row_class
from .store import DenseBuffer, EncodedStore, restore, snapshot, spare
from .views import CompressedView, bool_mask


#: Slots of the caches made in this process, in order (a model's layers are made in turn): see
#: :meth:`KVQCache._schedule_growth`.
_SLOTS = itertools.count()


@row_class
class KVQCache(CacheProtocol, DependencySlots, PromptCacheState):
    """A drop-in replacement for mlx-lm's ``KVCache`` that stores keys and values compressed.

    Works with ``mlx_lm.generate``/``stream_generate``/``generate_step`` (chunked prefill included), prompt-cache
    files (``save_prompt_cache``/``load_prompt_cache``), ``trim``, and batching (``merge``). Build it with
    :func:`kvq.make_prompt_cache`. ``nbytes`` is the bytes really allocated.

    :param config: :class:`CacheConfig`.
    """

    #: Whether rows of this class may be packed into one batched store for decode (:mod:`kvq.cache.packed`).
    PACKABLE = True
    #: Marks kvq's caches for mlx-lm's patched attention (:func:`kvq.cache.views.is_kvq_cache`).
    KVQ_CACHE = True

    def __init__(self, config: CacheConfig) -> None:
        self._config = config
        self.offset = 0
        self.sinks = DenseBuffer(config.sinks)
        self._flush = config.flush_tokens  # decided once: the decode path reads it every step
        self.window = DenseBuffer(most_held(config.window, self._flush))
        self.compressed_keys = EncodedStore(config.step)
        self.compressed_values = EncodedStore(config.step)
        self._layout = None  # (B, H, D_k, D_v, dtype), fixed by the first update
        self._token_shapes = None  # ([B, H, 1, D_k], [B, H, 1, D_v], dtype) of a decode token, once checked
        self._fresh = None  # schedule.Fresh of the last update, until attend uses it
        # the key mean subtracted from compressed keys and the channel scales divided out (kvq.cache.guard)
        self._transform = KeyTransform()
        self._bound = None  # (compressed keys' view, signature, decode step): _fused_attend's binding
        self._slot = next(_SLOTS)  # spreads the layers' store growths over decode steps (_grow_ahead)
        self._grow_at = -1  # the offset at which _append_one grows the stores ahead of the next flush (-1: none)

    @property
    def config(self) -> CacheConfig:
        """The layer's :class:`CacheConfig`: as made, with the budget's settings for its head_dims (at the first
        update) and, after its first compression, what the guard decided (:mod:`kvq.cache.guard`: an outlier layer's
        8-bit parameters) and fitted parameters (:class:`kvq.contract.Fits`). Settles a chunk's first compression
        first (:meth:`settle`)."""
        self.settle()
        return self._config

    @config.setter
    def config(self, config: CacheConfig) -> None:
        self._config = config

    @property
    def key_mean(self) -> mx.array | None:
        """A centred layer's key mean, float32 ``[B, H_kv, 1, D_k]`` (values of the sinks' and window's 16-bit
        dtype), subtracted from its keys before they are compressed (:mod:`kvq.cache.guard`); ``None`` otherwise."""
        self.settle()
        return self._transform.mean

    @property
    def key_scale(self) -> mx.array | None:
        """A scaled layer's per-channel key scales, float32 ``[B, H_kv, 1, D_k]`` (powers of two), by which its keys
        are divided before they are compressed and its queries multiplied (:func:`kvq.cache.guard.key_scales`);
        ``None`` otherwise."""
        self.settle()
        return self._transform.scale

    @property
    def layout(self) -> tuple | None:
        """``(B, H_kv, D_k, D_v, dtype)`` fixed by the first update, or ``None`` while empty."""
        return self._layout

    @property
    def pending_chunk(self) -> bool:
        """Whether the last update stored a chunk whose queries have not attended yet (:meth:`release_chunk`)."""
        return self._fresh is not None

    @property
    def sink_keys(self):
        """``[B, H, n_sinks, D]`` view of the uncompressed first tokens, or None."""
        return self.sinks.view()[0]

    @property
    def sink_values(self):
        """``[B, H, n_sinks, D_v]`` view of the uncompressed first tokens' values, or None."""
        return self.sinks.view()[1]

    @property
    def window_keys(self):
        """``[B, H, n_window, D]`` view of the uncompressed most recent tokens, or None."""
        return self.window.view()[0]

    @property
    def window_values(self):
        """``[B, H, n_window, D_v]`` view of the uncompressed most recent tokens' values, or None."""
        return self.window.view()[1]

    # -- storage ------------------------------------------------------------------------------------
    def _check(self, keys: mx.array, values: mx.array) -> None:
        float_array("keys", keys)
        float_array("values", values)
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must agree on B, H, T")
        if keys.dtype != values.dtype:
            raise TypeError(f"keys ({keys.dtype}) and values ({values.dtype}) must have the same dtype")
        layout = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
        if self._layout is None:
            self._config = self._config.within_budget(keys.shape[3], values.shape[3])  # kvq.cache.budget
            self._config.key_params.check_head_dim(keys.shape[3])
            self._config.value_params.check_head_dim(values.shape[3])
            self._layout = layout
        elif layout != self._layout:
            B, H, Dk, Dv, dt = self._layout
            raise ValueError(f"keys/values of layout (B={layout[0]}, H={layout[1]}, D_k={layout[2]}, "
                             f"D_v={layout[3]}, {layout[4]}) do not match this cache's (B={B}, H={H}, "
                             f"D_k={Dk}, D_v={Dv}, {dt})")
        if self._token_shapes is None:
            B, H, Dk, Dv, dt = self._layout
            self._token_shapes = ((B, H, 1, Dk), (B, H, 1, Dv), dt)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store new tokens (``[B, H_kv, T, D]`` keys and values); returns stand-ins for attention.

        A chunk of ``T`` tokens leaves the cache exactly as ``T`` single-token updates would (the same tokens
        compressed, in the same window), and the next :meth:`attend` lets each of the chunk's queries see what
        it would have seen in a token-by-token run (:func:`kvq.cache.schedule.visible`): so prefill gives the same result whatever
        the chunk size.

        A chunk's update that raises (bad input, or a quantizer that fails) leaves the cache as it was before
        it; a single token's bad input is refused before any change.

        :raises ValueError/TypeError: mismatched shapes or dtypes, or a head_dim the methods do not support.
        """
        if self._ahead is not None:
            self.settle()  # a chunk stored without attending: decided before the next update
        if self._FAST_APPEND and self._append_one(keys, values):
            return self._views()
        self._update(keys, values, ahead=self.DECIDE_AHEAD)
        return self._views()

    def _update(self, keys, values, ahead: bool) -> None:
        """:meth:`update_and_fetch`'s general path. A chunk (``T > 1``) is undone where it raises, and with
        ``ahead`` its first compression decides its guard without waiting for the device (:meth:`settle`)."""
        shape = getattr(keys, "shape", ())
        # a chunk (prefill): snapshot first, so a failure part-way leaves the cache as it was; a single token is
        # checked by _check before any change (decode steps, the hot path, make no snapshot)
        may_fail = len(shape) == 4 and shape[2] > 1
        saved = self._snapshot() if may_fail else None
        self._undo = (saved, keys, values) if may_fail and ahead else None  # for _fit_params: see settle
        try:
            self._check(keys, values)
            self._store(keys, values)
        except BaseException:
            if saved is not None:
                self._restore(saved)  # a failed update leaves the cache as it was before the chunk
            raise
        finally:
            self._undo = self._planned = None
        if 0 <= self._grow_at <= self.offset:  # a short chunk (speculative decoding's) stepped over it
            self._grow_ahead()

    #: Whether a chunk's first compression decides the layer's guard (:mod:`kvq.cache.guard`) without waiting for
    #: the device (:func:`kvq.cache.guard.decide_ahead`; settled when the chunk attends: :meth:`settle`). ``False``
    #: waits there, as every single-token update does (a benchmark's before-and-after switch).
    DECIDE_AHEAD = True
    #: A chunk's first compression still to settle: ``(Ahead, (snapshot before the chunk, keys, values))``.
    _ahead = None
    #: What :meth:`_fit_params` would need to store the chunk again (set during :meth:`_update` of a chunk).
    _undo = None
    #: The next update's first block decided together with other layers' (a batch's rows:
    #: :meth:`first_block_span`, :meth:`kvq.cache.BatchKVQCache.update_and_fetch`): a callable ``(config, shape of
    #: the first block) -> Ahead | None`` that :meth:`_fit_params` asks before deciding alone; dropped when the update
    #: ends.
    _planned = None

    def first_block_span(self, tokens: int) -> tuple[int, int] | None:
        """Where the first block this layer compresses lies in the next update's chunk of ``tokens`` tokens,
        ``(start, stop)`` along its tokens, where that update makes the layer's first compression from an empty
        cache and decides its guard ahead (:func:`kvq.cache.guard.decide_ahead`): the tokens after the sinks, as many
        as ``window + flush`` (:meth:`_fit_params`). ``None`` otherwise. A batch whose rows start a prefill together
        decides those blocks in one graph (:func:`kvq.cache.guard.decide_ahead_rows`)."""
        if self.offset or self._fitted or not self.DECIDE_AHEAD or tokens < 2:
            return None
        sinks = min(self._config.sinks, tokens)
        if not self._leaving(0, tokens - sinks):
            return None
        return sinks, sinks + min(self._config.window + self._flush, tokens - sinks)

    def share_first_block(self, decide) -> None:
        """Let the next update's first compression take its guard's decisions from ``decide(config, shape) -> Ahead
        | None`` (``shape``: of the first block it compresses; a batch's rows decided together:
        :class:`kvq.cache.guard.SharedFirstBlocks`, over the block :meth:`first_block_span` names), deciding alone
        where it gives ``None``; only for that update (``None``: no plan)."""
        self._planned = decide

    def settle(self) -> None:
        """Take the decisions of a chunk's first compression (:func:`kvq.cache.guard.decide_ahead`), evaluated by
        now, and keep what they say: the layer's mean and scales where it is centred or scaled, neither where not
        (its codes are the same either way). An outlier layer under ``"upgrade"`` changes its method: the chunk is
        stored again from the snapshot taken before it, deciding by waiting (:func:`kvq.cache.guard.guard_layer`),
        and its queries attend again (:meth:`attend`); should that fail, the chunk stays as it was stored, with the
        layer's method, and a warning says why (:func:`kvq.cache.guard.settle`). A no-op where nothing is left to
        settle; :meth:`attend`, the next update and the readers of the layer's state (``config``, ``state``,
        ``nbytes``, ``trim``, ``keys``/``values``, copies) call it, so a reader may store a chunk again: readers of one
        layer from two threads at once are not supported (nor are its updates)."""
        if self._ahead is None:
            return
        (ahead, (saved, keys, values)), self._ahead = self._ahead, None
        decided = settle(self._config, ahead)
        if decided is None:  # an outlier layer under "upgrade": the chunk stored again with the safe parameters
            stored = self._snapshot()
            self._restore(saved)
            try:
                self._update(keys, values, ahead=False)
                return
            except BaseException as error:
                self._restore(stored)  # the chunk as stored ahead: no token is lost
                if not isinstance(error, Exception):
                    raise
                decided = settle(self._config, ahead, failed=error)
        self._config, mean, scales = decided
        self._transform.set(mean, scales)

    #: Whether :meth:`update_and_fetch` takes :meth:`_append_one` (a subclass that stores tokens its own way: no).
    _FAST_APPEND = True
    #: Whether :meth:`_fit_params` has fitted this layer (its first compression); kept through trims.
    _fitted = False

    def _append_one(self, keys, values) -> bool:
        """The decode hot path of :meth:`update_and_fetch`: one token of this cache's checked layout and dtype
        joins a window that keeps it (the sinks are full and no token leaves the window), with what
        :meth:`_store` does then and nothing else (two slice assignments). ``False``, with nothing done, for
        every other update, which takes the general path."""
        shapes, window = self._token_shapes, self.window
        if (shapes is None or type(keys) is not mx.array or type(values) is not mx.array or keys.shape != shapes[0]
                or values.shape != shapes[1] or keys.dtype != shapes[2] or values.dtype != shapes[2]
                or window.keys is None or not window.length < window.capacity or window.capacity < 2
                or self.sinks.length < self._config.sinks):
            return False
        if keys.dtype != window.keys.dtype:  # float32 models: the window holds float16 (DenseBuffer)
            keys, values = keys.astype(window.keys.dtype), values.astype(window.values.dtype)
        n = window.length
        window.keys[:, :, n:n + 1] = keys
        window.values[:, :, n:n + 1] = values
        window.length = n + 1
        self.offset += 1
        self._fresh = None  # one token: its query sees the cache as it is after the update
        if self.offset == self._grow_at:
            self._grow_ahead()
        return True

    def _schedule_growth(self) -> None:
        """After a compression: where the stores lack room for the next flush, pick the decode step that grows
        them (:meth:`_grow_ahead`): one of the steps that only append to the window before that flush, chosen by
        this layer's slot, so the layers of a model grow on different steps. Growing copies a layer's store once;
        on CUDA the replaced arrays stay alive until the step's work has run, so when every layer grew in the
        flush step their copies were alive together (issue #52: on an H100, 48 sequences of 32K with
        turboquant:3 peaked 18.2 GB above the caches in that step, against 1.3 GB, one layer's store, grown
        ahead). From :data:`kvq.cache.store.SPARE_FROM` tokens a prefill chunk's compression leaves the next
        flush's room (:meth:`_compress`), so the layers do not all grow in the first decode steps after a prefill
        either. Not for :class:`kvq.cache.RotatingKVQCache` (its ring stores its own way; its growths still come
        in its flush steps). Where the window has no step between flushes (``flush`` 1), the flush grows the stores."""
        self._grow_at = -1
        store, step = self.compressed_keys, growth_append(self.window.capacity - self.window.length, self._slot)
        if step and store.capacity - store.length < self._flush:
            self._grow_at = self.offset + step

    def _grow_ahead(self) -> None:
        """Room in both compressed stores for the next flush's tokens (:meth:`EncodedStore.reserve`)."""
        self._grow_at = -1
        for store in (self.compressed_keys, self.compressed_values):
            store.reserve(store.length + self._flush)

    def _store(self, keys, values) -> None:
        first = self.offset
        self.offset += keys.shape[2]
        keys, values = self._fill_sinks(keys, values)
        taken = self.offset - first - keys.shape[2]
        if keys.shape[2] > 1:  # what the chunk's queries need from this update (attend uses it once)
            compressed, held = self.compressed_keys.length, self.window.length
            self._fresh = Fresh(first + taken, compressed, held, keys.shape[2], self._push_window(keys, values))
        else:  # one token: its query sees the cache as it is after the update
            self._fresh = None
            if keys.shape[2]:
                self._push_window(keys, values)

    def _parts_objects(self) -> tuple:
        return self, self.sinks, self.window, self.compressed_keys, self.compressed_values, self._transform

    def _snapshot(self) -> list[dict]:
        """:func:`kvq.cache.store.snapshot` of the cache and its parts (lazy: nothing is copied unless restored)."""
        return snapshot(self._parts_objects())

    def _restore(self, saved: list[dict]) -> None:
        restore(self._parts_objects(), saved)

    def _fill_sinks(self, keys, values):
        take = min(self._config.sinks - self.sinks.length, keys.shape[2])
        if take <= 0:
            return keys, values
        self.sinks.append(keys[:, :, :take], values[:, :, :take])
        return keys[:, :, take:], values[:, :, take:]

    def _leaving(self, held: int, new: int) -> int:
        """Tokens that leave the window when ``new`` tokens join the ``held`` ones (:func:`kvq.cache.schedule.
        leaving` of this layer's window and flush)."""
        return leaving(held, new, self._config.window, self._flush)

    def _push_window(self, keys, values):
        """Append non-sink tokens to the window, compressing those that leave it (:meth:`_leaving`). Returns the
        uncompressed ``(keys, values)`` of the window before the update followed by the new tokens (a chunk's
        queries attend to them where a token-by-token run still held them uncompressed)."""
        overflow = self._leaving(self.window.length, keys.shape[2])
        if not overflow:
            self.window.append(keys, values)  # no token leaves the window yet: one copy into the buffer
            return self.window.view()
        chunk = keys.shape[2] > 1
        held_k, held_v = self.window.view()
        if held_k is not None:
            keys = mx.concatenate([held_k, keys], axis=2)
            values = mx.concatenate([held_v, values], axis=2)
        self._fit_params(keys, values)
        self._compress(keys[:, :, :overflow], values[:, :, :overflow], chunk)
        self.window.replace(keys[:, :, overflow:], values[:, :, overflow:])
        self._schedule_growth()
        return keys, values

    def _compress(self, keys, values, chunk: bool = False):
        """Encode ``keys``/``values`` (the tokens leaving the window) and append them to the stores. A chunk's
        (``chunk``) leaves the next flush's room after them (:func:`kvq.cache.store.spare`), growing for it even
        where its own tokens fit, so that no layer is left to grow in the first decode steps after a prefill; a
        decode flush's room comes from :meth:`_schedule_growth`."""
        # the bound decode step holds views of the stores: dropped before the writes, which are then in place
        # (write_fields); the next decode binds again anyway, as the stores' views change
        self._bound = None
        encoded_keys, encoded_values = self._encode(keys, values)
        room = spare(self.compressed_keys.length + encoded_keys.num_tokens, self._flush) if chunk else 0
        self.compressed_keys.append(encoded_keys, spare=room)
        self.compressed_values.append(encoded_values, spare=room)

    def _encode(self, keys, values) -> tuple[Encoded, Encoded]:
        """``keys`` (centred and scaled where the layer is: :class:`~kvq.cache.centring.KeyTransform`) and
        ``values`` ``[B, H, T, D]`` quantized by the implementations :func:`kvq.select` picks: ``(Encoded keys,
        Encoded values)``."""
        return encode_tokens(self._config, self._transform.centred(keys), values)

    def _fit_params(self, keys, values):
        """Parameters with the optional ``fit(block)`` (:class:`kvq.contract.Fits`: shared state chosen from data,
        e.g. TurboQuant's data-chosen outlier channels) are fitted when this layer first compresses, on the first
        ``window + flush`` tokens after the sinks (what a token-by-token run holds then, so the fit does not
        depend on how the prompt was chunked) of ``keys``/``values``, the window's tokens followed by the new ones.
        The fitted parameters replace the configuration's: every block uses them, and prompt-cache files save them.
        Later flushes return at once, before any slice is made (a trim keeps the fitted state)."""
        if self.compressed_keys.length or self._fitted:
            return  # fitted once (a trim that removed every compressed token keeps the fit: it is not redone)
        first = self._config.window + self._flush
        keys, values = keys[:, :, :first], values[:, :, :first]

        def fit(params, block):
            hook = optional_hook(params, Fits)
            return params if hook is None else hook(block)

        # keys with constant offsets are centred, outlier layers stored at 8 bits, keys whose channels hold very
        # unequal energy scaled (powers of two) after centring: kvq.cache.guard
        ahead = None
        if self._undo is not None:  # a chunk: decided ahead (with a batch's other rows where they planned it)
            ahead = None if self._planned is None else self._planned(self._config, keys.shape)
            ahead = decide_ahead(self._config, keys) if ahead is None else ahead
        if ahead is not None:  # settled when the chunk attends (settle)
            self._ahead = (ahead, self._undo)
            self._transform.set(ahead.mean, ahead.scales)
        else:
            self._config, mean, scales = guard_layer(self._config, keys)
            self._transform.set(mean, scales)
        keys = self._transform.centred(keys)
        self._config = attrs.evolve(self._config, key_params=fit(self._config.key_params, keys),
                                    value_params=fit(self._config.value_params, values))
        self._fitted = True

    def _views(self):
        B, H, Dk, Dv, dtype = self._layout
        return (CompressedView((B, H, self.offset, Dk), dtype, self),
                CompressedView((B, H, self.offset, Dv), dtype, self))

    def keys_and_values(self):
        """mlx-lm's read of a layer's keys and values without an update (``KVCache.keys_and_values``), which
        KV-sharing models use to let later layers attend this layer's tokens (afm7, gemma3n): the stand-ins
        :meth:`update_and_fetch` returns, whose attention is this cache's; ``(None, None)`` while empty."""
        return (None, None) if self._layout is None else self._views()

    # -- attention ----------------------------------------------------------------------------------
    def attend(self, queries: mx.array, scale: float, mask=None, sink_logits: mx.array | None = None,
               query_start: int | None = None) -> mx.array:
        """Attention of ``queries [B, H_q, T_q, D]`` (the newest ``T_q`` tokens) over everything stored: what
        mlx-lm's attention calls for a kvq cache (:mod:`kvq.cache.patch`). Not the ``kvq_attend`` op hook, which
        attends over compressed tokens only; this attends every part (sinks, compressed, window) and merges them
        (:mod:`kvq.cache.engine`; :meth:`parts` says what each query row sees).

        :param mask: mlx-lm's mask: ``None``, ``"causal"``, or a boolean/additive array whose last axis spans
            all ``offset`` tokens (batch padding); causality is also enforced from token positions.
        :param sink_logits: optional learned attention-sink logits ``[H_q]`` (gpt-oss; mlx-lm's ``sinks=``), added
            to the softmax normaliser. Unrelated to the cache's sinks (its first tokens, kept uncompressed).
        :param query_start: position of the first query (default ``offset - T_q``; batches with padding pass it).
        :return: ``[B, H_q, T_q, D_v]`` in the queries' dtype.
        """
        Tq = queries.shape[2]
        fresh, self._fresh = self._fresh, None  # made by the update before this call; used once
        # the newest token (a batch row in decode passes its own start, which is this one): the fused decode path
        newest = query_start is None or query_start == self.offset - Tq
        if Tq == 1:
            after_chunk()  # a decode step: the last chunk's shared mask is no longer needed
        if Tq == 1 and (mask is None or isinstance(mask, str)) and sink_logits is None and newest:
            fused = self._fused_attend(queries, scale)
            if fused is not None:
                return fused
        if sink_logits is not None and self._ahead is not None:
            # on a GPU a chunk with learned sink logits attends its keys decoded and uncentred, which a layer not
            # centred decodes otherwise: settled first, it attends as the layer decided (an outlier layer's chunk,
            # stored again, with its own fresh chunk)
            self.settle()
            fresh, self._fresh = (fresh if self._fresh is None else self._fresh), None
        start_q = self.offset - Tq if query_start is None else query_start
        chunk = fresh if Tq > 1 else None
        on_device = chunk is not None and self._prefill_on_device(queries)
        out = engine.attend(queries, scale, self.parts(Tq, start_q, chunk), self._config, self._transform,
                            user_mask=bool_mask(mask), sink_logits=sink_logits, on_device=on_device)
        return out if self._ahead is None else self._settled(out, queries, scale, mask, sink_logits, query_start)

    def chunk_rows(self, count: int, query_start: int) -> tuple | None:
        """What a batch needs to attend this layer's chunk with its other rows' (:func:`kvq.cache.engine.attend_rows`):
        ``(parts, config, transform)`` for ``count`` query rows from position ``query_start`` over the chunk the last
        update stored, where :meth:`attend` would take the GPU chunk path (:meth:`_prefill_on_device`); ``None``
        otherwise (the row attends alone). Reads without settling: the decisions made ahead are kept by
        :meth:`chunk_attended`, after the call is queued."""
        if self._fresh is None or count < 2 or not self._prefill_on_device(None):
            return None
        return self.parts(count, query_start, self._fresh), self._config, self._transform

    def chunk_attended(self, out: mx.array, *attend_args) -> mx.array:
        """The end of :meth:`attend` for a chunk a batch attended with its other rows: ``out`` (this row's, ``[1,
        H_q, T_q, D_v]``) once the chunk is dropped and the first compression settled (:meth:`_settled`; ``out`` itself
        unless settling stored the chunk again, then this row's own attention). ``attend_args``: :meth:`attend`'s."""
        self._fresh = None
        return out if self._ahead is None else self._settled(out, *attend_args)

    def _settled(self, out: mx.array, *attend_args) -> mx.array:
        """``out``, a chunk's attention after its first compression was decided ahead, once :meth:`settle` has kept
        the decisions (made on the device by now); for an outlier layer under ``"upgrade"``, whose chunk settle
        stores again, the chunk's queries attend again (``attend_args``: :meth:`attend`'s)."""
        self.settle()
        return out if self._fresh is None else self.attend(*attend_args)

    def parts(self, count: int, start_q: int, fresh: Fresh | None = None) -> list[Part]:
        """This cache's tokens as the engine's parts ``[sinks | compressed | dense]``, with what each of ``count``
        query rows at positions ``start_q ...`` sees: its causal past in the cache as it is; or, for the rows of the
        chunk just stored (``fresh``), what a token-by-token run showed each (:func:`kvq.cache.schedule.visible`):
        the sinks before it, the tokens compressed by then, and the rest up to itself uncompressed (the window
        before the chunk followed by the chunk's tokens).

        :param count: query rows (``T_q``). :param start_q: the first row's position (tokens before it).
        :param fresh: the chunk the last update stored (:class:`kvq.cache.schedule.Fresh`), or ``None``.
        :return: the parts in order, those of no tokens left out (a chunk's dense part is always there); intervals
            are int64 ``[count]`` or ``None`` (every row sees every column).
        """
        positions = np.arange(start_q, start_q + count)
        n_sinks, n_compressed = self.sinks.length, self.compressed_keys.length
        parts = []
        if n_sinks:
            sink_keys, sink_values = self.sinks.view()
            lo, hi = causal(n_sinks, 0, positions)
            parts.append(Part(sink_keys, sink_values, False, 0, lo, hi, column=0))
        if fresh is None:  # the cache as it is: each row sees its causal past
            for start, n, buffers, compressed in (
                    (n_sinks, n_compressed, (self.compressed_keys, self.compressed_values), True),
                    (n_sinks + n_compressed, self.window.length, None, False)):
                if n:
                    keys, values = self.window.view() if buffers is None else (buffers[0].view(), buffers[1].view())
                    lo, hi = causal(n, start, positions)
                    parts.append(Part(keys, values, compressed, 0, lo, hi, column=start))
            return parts
        bounds = visible(fresh, start_q, count, self._config.window, self._flush)
        if n_compressed and bounds[-1]:
            lo, hi = (None, None) if bounds[0] >= n_compressed else (np.zeros_like(bounds), bounds)
            parts.append(Part(self.compressed_keys.view(), self.compressed_values.view(), True, 0, lo, hi,
                                     column=n_sinks))
        first = n_sinks + fresh.compressed  # position of the first uncompressed token after the sinks
        dense_k, dense_v = fresh.dense
        parts.append(Part(dense_k, dense_v, False, 0, bounds - fresh.compressed,
                                 np.clip(positions - first + 1, 0, dense_k.shape[2]), column=first))
        return parts

    def release_chunk(self) -> None:
        """Drop what the last update kept for its chunk's queries (the uncompressed window and chunk, up to
        ``window + flush - 1 + T`` tokens' keys and values): :meth:`attend` drops it itself, so only code that
        stores tokens without attending needs this (filling caches with random tokens in ``kvq bench``). Settles the
        chunk's first compression (:meth:`settle`)."""
        self.settle()
        self._fresh = None

    def _prefill_on_device(self, queries) -> bool:
        """Whether a chunk attends through MLX's fused attention over a transient dequantized copy of the
        compressed tokens (:func:`kvq.cache.prefill.attend_dequantized`): on a GPU, where the pure-MLX block
        protocol is slow for many query rows, for methods that can dequantize, and where nothing is compressed yet
        (a short prompt, a chat's first turn: its tokens all dense, attended as mlx-lm's KVCache attends them, in
        one fused call, and a batch's short prompts stacked in one: :mod:`kvq.cache.stacked`); the CPU keeps the
        parts."""
        return mx.default_device() == mx.gpu and self._chunk_fused()

    def _chunk_fused(self) -> bool:
        """:meth:`_prefill_on_device` on a GPU: nothing compressed yet, or methods whose pure-MLX implementations
        dequantize."""
        if not self.compressed_keys.length:
            return True
        kp, vp = self._config.key_params, self._config.value_params
        return all("dequantize" in implemented_ops(registry().implementations.get((p.method, "mlx")))
                   for p in (kp, vp))

    def decoded(self, dtype=mx.float32) -> tuple[mx.array, mx.array]:
        """The compressed tokens decoded to ``dtype``: keys ``[B, H, T, D_k]`` (a scaled layer's :attr:`key_scale`
        multiplied and a centred layer's :attr:`key_mean` added back) and values ``[B, H, T, D_v]``, for ``T``
        compressed tokens. A copy the cache does not keep (``kvq eval``'s attention error).

        :raises ValueError: no compressed tokens.
        """
        self.settle()
        if not self.compressed_keys.length:
            raise ValueError("this cache holds no compressed tokens to decode")
        config = self._config
        keys = self._transform.uncentred(dequantize(config, config.key_params, self.compressed_keys.view(), dtype))
        return keys, dequantize(config, config.value_params, self.compressed_values.view(), dtype)

    def _fused_attend(self, queries, scale):
        """Decode of one token in one fused call over the compressed tokens, the sinks and the window, where the
        chosen attend implementation offers it; ``None`` otherwise (the parts are attended and merged).

        The hot path of decode: bound once (:func:`kvq.cache.engine.bind_decode`) and replayed while the compressed
        tokens (the store's view object), the queries' shape and dtype, the scale and the installed plugins stay
        the same, so a step is one slice of the window and one launch (:class:`kvq.contract.BindsDense`)."""
        keys = self.compressed_keys.view()
        n = self.window.length
        if keys is None or not n:
            return None
        bound = self._bound
        signature = (queries.shape, queries.dtype, scale, registry().generation)
        if bound is None or bound[0] is not keys or bound[1] != signature:
            sink_keys, sink_values = self.sinks.view()
            window_keys, window_values = self.window.view()
            step = engine.bind_decode(self._config, self._transform.queries(queries), scale, keys,
                                      self.compressed_values.view(),
                                      self._transform.centred_dense(sink_keys), sink_values, window_keys, window_values)
            bound = self._bound = (keys, signature, step)
        step = bound[2]
        if step is None:
            return None
        window = self.window
        # a centred (scaled) layer scores its sinks and window from centred (scaled) keys too, with scaled queries:
        # every score then lacks the same scale * q . mu, which the softmax does not see
        transform = self._transform
        return step(transform.queries(queries), transform.centred_dense(window.keys[:, :, :n]), window.values[:, :, :n])

    @property
    def nbytes(self) -> int:
        """Bytes resident: sinks, window, the allocated compressed store (codes and side data) and a centred
        layer's key mean and a scaled layer's key scales."""
        self.settle()
        side = sum(x.nbytes for x in (self.key_mean, self.key_scale) if x is not None)
        return self.sinks.nbytes + self.window.nbytes + self.compressed_keys.nbytes + self.compressed_values.nbytes + side

