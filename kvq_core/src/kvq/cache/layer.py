"""``KVQCache``: one layer's KV cache for mlx-lm that stores compressed keys and values.

Layout along the token axis: sinks (the first ``sinks`` tokens, uncompressed) | compressed tokens (the
methods' :class:`kvq.Encoded` form, in an :class:`EncodedStore`) | residual window (the most recent
``window`` tokens, uncompressed). A token leaves the window for the compressed store as soon as a newer token
pushes it out. Attention (:meth:`KVQCache.attend`) runs on each part and merges them with log-sum-exp, so no
fp16 copy of compressed tokens is made.

Sinks and window follow StreamingLLM (Xiao et al., arXiv 2309.17453) and KIVI's residual (arXiv 2402.02750).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from ..attention import DenseTokens, attend_encoded, dense_attend, merge_parts, sink_logits_part
from ..contract import (AttendsDense, BindsDense, EncodesBlocks, Fits, ForHeads, ForLayer, ScoresKeys, WeightsValues,
                        member_name, optional_hook)
from ..defaults import DEFAULT_FLUSH
from ..plugins import implemented_ops, registry
from ..select import MAX_DECODE_QUERIES, check_kernels, is_kernel, select
from ..validate import float_array
from ..encoded import Encoded
from .guard import check_policy, guard_layer
from .prefill import IN_FLIGHT, chunk_mask, rows_per_call
from .reuse import check_trim, trimmable_now
from .state import check_layer, config_from_json, config_to_json
from .store import DenseBuffer, EncodedStore


@attrs.frozen
class CacheConfig:
    """What a layer stores and how: key and value methods with their parameters, sinks and window sizes.

    :param key_params: parameter object of the keys' method (``key_params.method`` names it).
    :param value_params: parameter object of the values' method.
    :param sinks: first tokens kept uncompressed (>= 0; default 4).
    :param window: most recent tokens kept uncompressed (>= 0; default 128).
    :param step: tokens per allocation step of the compressed store.
    :param flush: tokens leave the window for the compressed store in blocks of ``flush`` (>= 1; default
        :data:`DEFAULT_FLUSH`, 128):
        the window then holds ``window`` to ``window + flush - 1`` tokens. A block (KIVI's residual, arXiv
        2402.02750, flushes whole groups) quantizes once every ``flush`` steps, so a decode step is an append and
        one launch; a step that compresses costs several times more on the host (on an H200 at 32K: 14 ms of
        graph building against 4, ``benchmarks/results/host/README.md``). 1 compresses one token every decode
        step (the window then holds exactly ``window`` tokens).
    :param kernels: ``"auto"`` (default), ``"require"`` or ``"off"`` (:data:`kvq.select.KERNELS`): which
        implementations the cache's hot path may use. ``require``: attention must run in a kernel (checked by
        :func:`kvq.make_prompt_cache` at construction) and quantize runs in a kernel wherever the method has
        one. A run-time preference of this process: it is not written to prompt-cache files.
    :param outlier_layers: ``"upgrade"`` (default), ``"warn"`` or ``"off"``: what the layer does when the keys of
        the first block it compresses show outlier channels that low-bit keys cannot hold
        (:mod:`kvq.cache.guard`: stored with affine 8-bit instead, with a warning; warn only; nothing). A run-time
        preference, not written to prompt-cache files (the parameters a layer ends up with are).
    :param layer: the layer's index in the model (set by :meth:`for_layer`; named in warnings), or ``None``; not
        compared (two layers' equal configurations are equal).
    :param outlier_layer: set by the guard when this layer's first compressed block showed outlier channels
        (whatever the policy did about it); written to prompt-cache files.
    """

    key_params: Any
    value_params: Any
    sinks: int = attrs.field(default=4)
    window: int = attrs.field(default=128)
    step: int = attrs.field(default=256)
    kernels: str = attrs.field(default="auto", validator=lambda i, a, v: check_kernels(v))
    flush: int = attrs.field(default=DEFAULT_FLUSH)
    outlier_layers: str = attrs.field(default="upgrade", validator=lambda i, a, v: check_policy(v))
    layer: int | None = attrs.field(default=None, eq=False)
    outlier_layer: bool = attrs.field(default=False)

    @flush.validator
    @sinks.validator
    @window.validator
    @step.validator
    def _non_negative(self, attribute, value):
        low = 1 if attribute.name in ("step", "flush") else 0
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{attribute.name} must be an int >= {low}; got {value!r}")

    @property
    def flush_tokens(self) -> int:
        """Tokens per compression: ``flush``, made a multiple of both sides' block (:class:`kvq.contract.
        EncodesBlocks`, e.g. QJL's outlier groups) by taking their least common multiple. The window holds
        ``window`` to ``window + flush_tokens - 1`` tokens."""
        blocks = [self.flush]
        for params in (self.key_params, self.value_params):
            hook = optional_hook(params, EncodesBlocks)
            if hook is not None:
                blocks.append(hook())
        return math.lcm(*blocks)

    def for_layer(self, layer: int) -> "CacheConfig":
        """This configuration for layer ``layer`` (its index in the whole model): parameters with the optional
        ``for_layer`` (:class:`kvq.contract.ForLayer`: per-layer calibration such as VecInfer's codebooks) are
        specialised; the others are shared."""
        return attrs.evolve(self._specialised(ForLayer, layer), layer=layer)

    def for_heads(self, start: int, stop: int) -> "CacheConfig":
        """This configuration for a cache holding KV heads ``start:stop`` of the model (one tensor-parallel rank's):
        parameters with the optional ``for_heads`` (:class:`kvq.contract.ForHeads`: per-head state) are
        specialised; the others are shared."""
        return self._specialised(ForHeads, start, stop)

    def _specialised(self, protocol, *args) -> "CacheConfig":
        def specialise(params):
            hook = optional_hook(params, protocol)
            return params if hook is None else hook(*args)

        return attrs.evolve(self, key_params=specialise(self.key_params), value_params=specialise(self.value_params))

    def check_head_dim(self, head_dim: int) -> None:
        """:raises ValueError: a head_dim that the key or value method does not support."""
        self.key_params.check_head_dim(head_dim)
        self.value_params.check_head_dim(head_dim)


def quantize_kernels(method: str, kernels: str) -> str:
    """The ``kernels`` preference for quantize: ``require`` applies only where ``method`` has a registered
    quantize kernel (e.g. affine's ``mx.quantize`` is already one fused MLX kernel)."""
    if kernels == "require" and not any(is_kernel(i) for i in registry().implementations_of(method, "quantize")):
        return "auto"
    return kernels


def attend_kernels(kernels: str, num_queries: int) -> str:
    """The ``kernels`` preference for attention over ``num_queries`` queries: the fused kernels are decode
    kernels, so ``require`` is enforced for decode (``T_q <= MAX_DECODE_QUERIES``) and prefill chunks use
    the best available implementation."""
    return "auto" if kernels == "require" and num_queries > MAX_DECODE_QUERIES else kernels


_HAS_ATTEND: dict = {}


def has_attend(method: str) -> bool:
    """Whether an installed implementation of ``method`` offers ``kvq_attend`` (once per registry change)."""
    reg = registry()
    key = (method, reg.generation)
    if key not in _HAS_ATTEND:
        _HAS_ATTEND[key] = bool(reg.implementations_of(method, "attend"))
    return _HAS_ATTEND[key]


def block_implementation(method: str, side: str):
    """The implementation that attends over ``method``'s codes on one ``side`` (``"keys"`` or ``"values"``) where
    no ``kvq_attend`` serves them (:func:`kvq.attention.attend_encoded`): the pure-MLX one with that side's block
    hook (:class:`kvq.contract.ScoresKeys` / :class:`kvq.contract.WeightsValues`) or ``kvq_dequantize``, else any
    implementation that dequantizes (one block at a time, never the whole cache).

    :raises ValueError: none of ``method``'s implementations can (no block hook, no ``kvq_dequantize``).
    """
    reg = registry()
    protocol = ScoresKeys if side == "keys" else WeightsValues
    mlx = reg.implementations.get((method, "mlx"))
    if mlx is not None and (optional_hook(mlx, protocol) is not None or "dequantize" in implemented_ops(mlx)):
        return mlx
    candidates = reg.implementations_of(method, "dequantize")
    if not candidates:
        raise ValueError(f"method {method!r} cannot serve the {side}: no installed implementation offers "
                         f"kvq_attend, a pure-MLX {member_name(protocol)}, or kvq_dequantize")
    return candidates[0]


def encode_tokens(config: CacheConfig, keys: mx.array, values: mx.array) -> tuple[Encoded, Encoded]:
    """``keys`` (already centred where the layer is) and ``values`` ``[B, H, T, D]`` quantized with ``config``'s
    parameters by the implementations :func:`kvq.select` picks: ``(Encoded keys, Encoded values)``; what a cache's
    window flush stores (:class:`KVQCache`, and the packed rows of :mod:`kvq.cache.packed`)."""
    kp, vp = config.key_params, config.value_params
    quantize_k = select(kp.method, keys.shape, dtype=keys.dtype, op="quantize", params=kp,
                        kernels=quantize_kernels(kp.method, config.kernels)).quantize
    quantize_v = select(vp.method, values.shape, dtype=values.dtype, op="quantize", params=vp,
                        kernels=quantize_kernels(vp.method, config.kernels)).quantize
    return quantize_k(keys, kp), quantize_v(values, vp)


def centred(keys: mx.array, mean: mx.array | None) -> mx.array:
    """``keys`` ``[B, H, T, D]`` less a centred layer's key ``mean`` (float32 ``[B or 1, H, 1, D]``; computed in
    float32, returned in ``keys``' dtype); ``keys`` itself where ``mean`` is ``None`` (:mod:`kvq.cache.guard`)."""
    if mean is None:
        return keys
    return (keys.astype(mx.float32) - mean).astype(keys.dtype)


def mean_logits(mean: mx.array, queries: mx.array, scale: float) -> mx.array:
    """``scale * q . mu`` ``[B, H_q, T_q]`` float32 for ``queries [B, H_q, T_q, D]`` and a key ``mean`` (float32
    ``[B or 1, H_kv, 1, D]``): what the compressed tokens' scores lack when they are scored from centred keys (GQA:
    each query head reads its KV head's mean)."""
    B, Hq, Tq, D = queries.shape
    Hkv = mean.shape[1]
    q = queries.astype(mx.float32).reshape(B, Hkv, Hq // Hkv, Tq, D)
    mean = mx.broadcast_to(mean, (B, Hkv, 1, D))[:, :, None]  # [B, H_kv, 1, 1, D]
    return (scale * mx.sum(q * mean, axis=-1)).reshape(B, Hq, Tq)


class CompressedView:
    """Stand-in returned by ``update_and_fetch``: models pass it on to attention, which kvq intercepts.

    It carries the logical ``shape`` ``(B, H_kv, T, D)`` and ``dtype`` for code that inspects them, and the
    ``cache`` that made it: attention over these keys is that cache's (:mod:`kvq.cache.patch`), whichever cache
    the model names in the call (a KV-sharing layer of gemma4 attends an earlier layer's keys and names none;
    iquestloopcoder's second loop attends its first loop's keys naming its own).
    """

    __slots__ = ("shape", "dtype", "ndim", "cache")

    def __init__(self, shape: tuple[int, ...], dtype, cache=None) -> None:
        self.shape, self.dtype, self.cache = shape, dtype, cache
        self.ndim = len(shape)


@attrs.frozen
class _Fresh:
    """What :meth:`KVQCache.attend` needs from the update just made, to give each query of a chunk what a
    token-by-token run would show it: ``start`` the position of the update's first token after the sinks,
    ``compressed`` and ``held`` the compressed and window tokens before the update, ``new`` the tokens it added
    after the sinks, ``dense`` the window before the update followed by those tokens, uncompressed (keys,
    values)."""

    start: int
    compressed: int
    held: int
    new: int
    dense: tuple


class KVQCache:
    """A drop-in replacement for mlx-lm's ``KVCache`` that stores keys and values compressed.

    Works with ``mlx_lm.generate``/``stream_generate``/``generate_step`` (chunked prefill included), prompt-cache
    files (``save_prompt_cache``/``load_prompt_cache``), ``trim``, and batching (``merge``). Build it with
    :func:`kvq.make_prompt_cache`. ``nbytes`` is the bytes really allocated.

    :param config: :class:`CacheConfig`.
    """

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.offset = 0
        self.sinks = DenseBuffer(config.sinks)
        self._flush = config.flush_tokens  # decided once: the decode path reads it every step
        self.window = DenseBuffer(config.window + self._flush - 1)
        self.compressed_keys = EncodedStore(config.step)
        self.compressed_values = EncodedStore(config.step)
        self._layout = None  # (B, H, D_k, D_v, dtype), fixed by the first update
        self._token_shapes = None  # ([B, H, 1, D_k], [B, H, 1, D_v], dtype) of a decode token, once checked
        self._fresh = None  # _Fresh of the last update, until attend uses it
        # float32 [B, H, 1, D_k] (values of the dense buffers' 16-bit dtype) subtracted from compressed keys
        # (kvq.cache.guard), or None
        self.key_mean = None
        self._key_mean_cast = None  # key_mean in the model's dtype, for the decode hot path
        self._bound = None  # (compressed keys' view, signature, decode step): _fused_attend's binding

    @property
    def sink_keys(self):
        """``[B, H, n_sinks, D]`` view of the uncompressed first tokens, or None."""
        return self.sinks.view()[0]

    @property
    def sink_values(self):
        return self.sinks.view()[1]

    @property
    def window_keys(self):
        """``[B, H, n_window, D]`` view of the uncompressed most recent tokens, or None."""
        return self.window.view()[0]

    @property
    def window_values(self):
        return self.window.view()[1]

    # -- keys/values: only for mlx-lm's pipeline parallelism (issue #10) -------------------------------
    # mlx-lm's pipelined models (mlx-lm 0.32: qwen2, qwen3_moe, deepseek_v2/v3, glm4_moe, mistral4, ministral3 ...)
    # run ``cache[-1].keys = mx.depends(cache[-1].keys, h)`` on every rank that sends ``h`` on, because
    # generate_step evaluates only ``[c.state for c in cache]`` and the send must be part of that graph. Nothing
    # else in mlx-lm reads a kvq cache's keys or values: masks come from make_mask, emptiness from empty(),
    # files from state, batching from merge/extract. So these are not the keys; they are one stored array.
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
        when the cache is empty."""
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
            self.config.key_params.check_head_dim(keys.shape[3])
            self.config.value_params.check_head_dim(values.shape[3])
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
        it would have seen in a token-by-token run (:meth:`_visible`): so prefill gives the same result whatever
        the chunk size.

        A chunk's update that raises (bad input, or a quantizer that fails) leaves the cache as it was before
        it; a single token's bad input is refused before any change.

        :raises ValueError/TypeError: mismatched shapes or dtypes, or a head_dim the methods do not support.
        """
        if self._FAST_APPEND and self._append_one(keys, values):
            return self._views()
        shape = getattr(keys, "shape", ())
        # a chunk (prefill): snapshot first, so a failure part-way leaves the cache as it was; a single token is
        # checked by _check before any change (decode steps, the hot path, make no snapshot)
        may_fail = len(shape) == 4 and shape[2] > 1
        saved = self._snapshot() if may_fail else None
        try:
            self._check(keys, values)
            self._store(keys, values)
        except BaseException:
            if saved is not None:
                self._restore(saved)  # a failed update leaves the cache as it was before the chunk
            raise
        return self._views()

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
                or self.sinks.length < self.config.sinks):
            return False
        if keys.dtype != window.keys.dtype:  # float32 models: the window holds float16 (DenseBuffer)
            keys, values = keys.astype(window.keys.dtype), values.astype(window.values.dtype)
        n = window.length
        window.keys[:, :, n:n + 1] = keys
        window.values[:, :, n:n + 1] = values
        window.length = n + 1
        self.offset += 1
        self._fresh = None  # one token: its query sees the cache as it is after the update
        return True

    def _store(self, keys, values) -> None:
        first = self.offset
        self.offset += keys.shape[2]
        keys, values = self._fill_sinks(keys, values)
        taken = self.offset - first - keys.shape[2]
        if keys.shape[2] > 1:  # what the chunk's queries need from this update (attend uses it once)
            compressed, held = self.compressed_keys.length, self.window.length
            self._fresh = _Fresh(first + taken, compressed, held, keys.shape[2], self._push_window(keys, values))
        else:  # one token: its query sees the cache as it is after the update
            self._fresh = None
            if keys.shape[2]:
                self._push_window(keys, values)

    def _parts_objects(self) -> tuple:
        return self, self.sinks, self.window, self.compressed_keys, self.compressed_values

    def _snapshot(self) -> list[dict]:
        """The attributes of the cache and its stores, with new handles on every array (stores update their
        arrays in place with slice assignments; a handle made before keeps the old contents). Lazy: nothing is
        copied unless :meth:`_restore` puts them back and they are evaluated."""
        def keep(value):
            if isinstance(value, mx.array):
                return mx.array(value)
            if isinstance(value, dict):
                return {k: keep(v) for k, v in value.items()}
            return value

        return [{k: keep(v) for k, v in vars(obj).items()} for obj in self._parts_objects()]

    def _restore(self, saved: list[dict]) -> None:
        for obj, attributes in zip(self._parts_objects(), saved):
            vars(obj).clear()
            vars(obj).update(attributes)

    def _fill_sinks(self, keys, values):
        take = min(self.config.sinks - self.sinks.length, keys.shape[2])
        if take <= 0:
            return keys, values
        self.sinks.append(keys[:, :, :take], values[:, :, :take])
        return keys[:, :, take:], values[:, :, take:]

    def _leaving(self, held: int, new: int) -> int:
        """Tokens that leave the window when ``new`` tokens join the ``held`` ones, as ``new`` single-token
        updates would have it: the window grows to ``window + f - 1`` tokens, then its oldest ``f`` are
        compressed together (``f`` = :attr:`CacheConfig.flush_tokens`); so a multiple of ``f`` (0 while fewer
        than ``window + f`` are held)."""
        w, f = self.config.window, self._flush
        return f * max(0, (held + new - w) // f)

    def _push_window(self, keys, values):
        """Append non-sink tokens to the window, compressing those that leave it (:meth:`_leaving`). Returns the
        uncompressed ``(keys, values)`` of the window before the update followed by the new tokens (a chunk's
        queries attend to them where a token-by-token run still held them uncompressed)."""
        overflow = self._leaving(self.window.length, keys.shape[2])
        if not overflow:
            self.window.append(keys, values)  # no token leaves the window yet: one copy into the buffer
            return self.window.view()
        held_k, held_v = self.window.view()
        if held_k is not None:
            keys = mx.concatenate([held_k, keys], axis=2)
            values = mx.concatenate([held_v, values], axis=2)
        self._fit_params(keys, values)
        self._compress(keys[:, :, :overflow], values[:, :, :overflow])
        self.window.replace(keys[:, :, overflow:], values[:, :, overflow:])
        return keys, values

    def _compress(self, keys, values):
        encoded_keys, encoded_values = self._encode(keys, values)
        self.compressed_keys.append(encoded_keys)
        self.compressed_values.append(encoded_values)

    def _encode(self, keys, values) -> tuple[Encoded, Encoded]:
        """``keys`` (centred where the layer is) and ``values`` ``[B, H, T, D]`` quantized by the implementations
        :func:`kvq.select` picks: ``(Encoded keys, Encoded values)``."""
        return encode_tokens(self.config, self._centred(keys), values)

    def _fit_params(self, keys, values):
        """Parameters with the optional ``fit(block)`` (:class:`kvq.contract.Fits`: shared state chosen from data,
        e.g. TurboQuant's data-chosen outlier channels) are fitted when this layer first compresses, on the first
        ``window + flush`` tokens after the sinks (what a token-by-token run holds then, so the fit does not
        depend on how the prompt was chunked) of ``keys``/``values``, the window's tokens followed by the new ones.
        The fitted parameters replace the configuration's: every block uses them, and prompt-cache files save them.
        Later flushes return at once, before any slice is made (a trim keeps the fitted state)."""
        if self.compressed_keys.length or self._fitted:
            return  # fitted once (a trim that removed every compressed token keeps the fit: it is not redone)
        first = self.config.window + self._flush
        keys, values = keys[:, :, :first], values[:, :, :first]

        def fit(params, block):
            hook = optional_hook(params, Fits)
            return params if hook is None else hook(block)

        # keys with constant offsets are centred; outlier layers stored at 8 bits (kvq.cache.guard)
        self.config, mean = guard_layer(self.config, keys)
        if mean is not None:
            # a mean the sinks' and window's 16-bit dtype holds exactly: the fused kernel scores them centred in that
            # dtype (k - mu there is exact where the offsets dominate), with no rounded shift against the codes
            mean = mean.astype(mx.float16 if keys.dtype == mx.float32 else keys.dtype).astype(mx.float32)
        self._set_key_mean(mean)
        keys = self._centred(keys)
        self.config = attrs.evolve(self.config, key_params=fit(self.config.key_params, keys),
                                   value_params=fit(self.config.value_params, values))
        self._fitted = True

    def _set_key_mean(self, mean) -> None:
        self.key_mean, self._key_mean_cast = mean, None

    def _centred(self, keys):
        """``keys`` less :attr:`key_mean` (:func:`centred`)."""
        return centred(keys, self.key_mean)

    def _centred_dense(self, keys):
        """Uncompressed ``keys`` (the sinks, the window) less :attr:`key_mean` in their own dtype, for attention
        that scores them together with the centred compressed keys (one subtraction; the mean is cast once)."""
        if self.key_mean is None or keys is None:
            return keys
        if self._key_mean_cast is None or self._key_mean_cast.dtype != keys.dtype:
            self._key_mean_cast = self.key_mean.astype(keys.dtype)
        return keys - self._key_mean_cast

    def _mean_logits(self, queries, scale):
        """:func:`mean_logits` of this layer's :attr:`key_mean`."""
        return mean_logits(self.key_mean, queries, scale)

    def _uncentre(self, part, queries, scale):
        """A compressed part's ``(out, lse)`` with the mean's logits added to its log-sum-exp (exact: every score of
        the part lacks the same ``scale * q . mu``, so its softmax, ``out``, is unchanged)."""
        if self.key_mean is None:
            return part
        out, lse = part
        return out, lse + self._mean_logits(queries, scale)

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
        attends over compressed tokens only; this attends every part (sinks, compressed, window) and merges them.

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
        if Tq == 1 and (mask is None or isinstance(mask, str)) and sink_logits is None and newest:
            fused = self._fused_attend(queries, scale)
            if fused is not None:
                return fused
        start_q = self.offset - Tq if query_start is None else query_start
        user_mask = _bool_mask(mask)
        if Tq > 1 and fresh is not None:
            if self._prefill_on_device(queries):
                return self._chunk_attend_dequantized(queries, scale, start_q, user_mask, fresh, sink_logits)
            parts = self._chunk_parts(queries, scale, start_q, user_mask, fresh)
        else:  # one query (what it sees is the cache as it is now), or no update before this call
            q_pos = mx.arange(start_q, start_q + Tq)
            parts, start = [], 0
            for kind, length in self._parts():
                part_mask = self._part_mask(q_pos, start_q, start, length, user_mask)
                parts.append(self._attend_part(kind, queries, scale, part_mask))
                start += length
        if sink_logits is not None:
            parts.append(sink_logits_part(sink_logits, queries, parts[0][0].shape[-1]))
        out, _ = merge_parts(parts)
        return out.astype(queries.dtype)

    def release_chunk(self) -> None:
        """Drop what the last update kept for its chunk's queries (the uncompressed window and chunk, up to
        ``window + flush - 1 + T`` tokens' keys and values): :meth:`attend` drops it itself, so only code that
        stores tokens without attending needs this (filling caches with random tokens in ``kvq bench``)."""
        self._fresh = None

    def _visible(self, fresh: _Fresh, start_q: int, count: int) -> list[int]:
        """Compressed tokens each query at positions ``start_q .. start_q + count - 1`` sees in a token-by-token
        run: those compressed before the update, plus those that had left the window by the time that query's own
        token was added (:meth:`_leaving` of the tokens added by then, computed for all rows at once: a chunk's
        rows times the model's layers, per chunk, made one Python call per row cost as much as the attention)."""
        w, f = self.config.window, self._flush
        added = np.clip(np.arange(start_q, start_q + count) - fresh.start + 1, 0, fresh.new)
        return (fresh.compressed + f * np.maximum(0, (fresh.held + added - w) // f)).tolist()

    #: Query rows per slice of the uncompressed part of a chunk (each slice reads only the keys it may see).
    CHUNK_ROWS = 256
    #: Bytes of one call's additive mask (query rows x keys, in the queries' dtype) in a chunk's attention on a GPU
    #: (:meth:`_chunk_attend_dequantized`); a larger chunk is attended in slices of rows.
    PREFILL_MASK_BYTES = 1 << 30
    #: Bytes of attention scores one call may materialise where MLX has no fused attention for the chunk (float32,
    #: or head_dim above 128, on CUDA: MLX computes rows x keys x query heads scores, float32 for the softmax).
    PREFILL_SCORES_BYTES = 1 << 29
    #: Bytes of transient decoded copies and masks that chunk attentions may hold queued on the device
    #: (:class:`kvq.cache.prefill.InFlight`); 0 evaluates each layer's before the next is built.
    PREFILL_INFLIGHT_BYTES = 1 << 29

    def _prefill_on_device(self, queries) -> bool:
        """Whether a chunk attends through MLX's fused attention over a transient dequantized copy of the
        compressed tokens (:meth:`_chunk_attend_dequantized`): on a GPU, where the pure-MLX block protocol is
        slow for many query rows, for methods that can dequantize; the CPU keeps :meth:`_chunk_parts`."""
        if mx.default_device() != mx.gpu or not self.compressed_keys.length:
            return False
        kp, vp = self.config.key_params, self.config.value_params
        return all("dequantize" in implemented_ops(registry().implementations.get((p.method, "mlx")))
                   for p in (kp, vp))

    def _dequantized(self, store, params, dtype):
        """The compressed tokens of ``store`` decoded to ``dtype`` ``[B, H, T, D]`` (the implementation
        :func:`kvq.select` picks for dequantize: a fused kernel where one serves)."""
        encoded = store.view()
        plan = select(params.method, encoded.shape, dtype=dtype, op="dequantize", params=params,
                      kernels=quantize_kernels(params.method, self.config.kernels))
        return plan.dequantize(encoded, dtype)

    def decoded(self, dtype=mx.float32) -> tuple[mx.array, mx.array]:
        """The compressed tokens decoded to ``dtype``: keys ``[B, H, T, D_k]`` (a centred layer's :attr:`key_mean`
        added back) and values ``[B, H, T, D_v]``, for ``T`` compressed tokens. A copy the cache does not keep
        (prefill on a GPU, ``kvq eval``'s attention error).

        :raises ValueError: no compressed tokens.
        """
        if not self.compressed_keys.length:
            raise ValueError("this cache holds no compressed tokens to decode")
        keys = self._dequantized(self.compressed_keys, self.config.key_params, dtype)
        if self.key_mean is not None:
            keys = (keys.astype(mx.float32) + self.key_mean).astype(dtype)
        return keys, self._dequantized(self.compressed_values, self.config.value_params, dtype)

    def _chunk_attend_dequantized(self, queries, scale, start_q, user_mask, fresh: _Fresh, sink_logits):
        """A chunk's attention with the visibility of :meth:`_chunk_parts`, in ``mx.fast.scaled_dot_product_
        attention`` over ``[sinks | compressed tokens decoded to the queries' dtype | fresh.dense]`` with the
        additive mask of :func:`kvq.cache.prefill.chunk_mask` (one call per chunk unless
        :func:`kvq.cache.prefill.rows_per_call` cuts it). The decoded copy is transient: the call is queued on
        the device (:data:`kvq.cache.prefill.IN_FLIGHT`) and the copy freed once it has run; the cache keeps only
        the codes. Memory above the cache: at most :attr:`PREFILL_INFLIGHT_BYTES` plus one layer's
        ``2 * T * H_kv * (D_k + D_v) * 2`` bytes of decoded keys and values (with their concatenation) and
        ``T_q * T * 2`` bytes of mask (16-bit queries), for ``T`` tokens held.

        :return: ``[B, H_q, T_q, D_v]`` in the queries' dtype."""
        Tq, dtype = queries.shape[2], queries.dtype
        bounds = self._visible(fresh, start_q, Tq)
        # a centred layer attends centred keys throughout (as the fused decode kernel does): every score lacks the
        # same scale * q . mu, which the softmax does not see, and 16-bit centred keys keep the bits that 16-bit
        # keys with offsets in the hundreds lose. Learned sink logits would see the shift: then the mean goes back.
        keys, values = self._chunk_keys(dtype, fresh, centre=self.key_mean is not None and sink_logits is None)
        user_cols = None
        if user_mask is not None:
            dense_start = self.sinks.length + self.compressed_keys.length
            first = self.sinks.length + fresh.compressed
            user_cols = mx.concatenate([mx.arange(dense_start), first + mx.arange(fresh.dense[0].shape[2])])
        sinks = None if sink_logits is None else sink_logits.astype(dtype)
        rows = rows_per_call(queries, keys.shape[2], self.PREFILL_MASK_BYTES, self.PREFILL_SCORES_BYTES)
        outs = []
        for r0 in range(0, Tq, rows):
            r1 = min(Tq, r0 + rows)
            end, mask = self._chunk_mask(bounds, start_q, r0, r1, fresh, dtype, user_mask, user_cols)
            outs.append(mx.fast.scaled_dot_product_attention(queries[:, :, r0:r1], keys[:, :, :end],
                                                             values[:, :, :end], scale=scale, mask=mask,
                                                             sinks=sinks))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
        transient = 2 * (keys.nbytes + values.nbytes) + min(rows, Tq) * keys.shape[2] * dtype.size * queries.shape[0]
        IN_FLIGHT.push(out, transient, self.PREFILL_INFLIGHT_BYTES)
        return out

    def _chunk_keys(self, dtype, fresh: _Fresh, centre: bool) -> tuple[mx.array, mx.array]:
        """The key columns a chunk attends on a GPU (:meth:`_chunk_attend_dequantized`): ``[sinks | compressed
        tokens decoded to dtype | fresh.dense]`` keys and values, ``[B, H, S + C + W', D]`` in ``dtype`` (``S``
        sinks, ``C`` compressed tokens after the update, ``W'`` the window before the update and the chunk's
        tokens); ``centre``: keys with the layer's :attr:`key_mean` subtracted (the compressed ones as stored)."""
        centred = self._centred_dense if centre else (lambda k: k)
        dense_k, dense_v = fresh.dense
        parts_k, parts_v = [], []
        if self.sinks.length:
            sk, sv = self.sinks.view()
            parts_k.append(centred(sk).astype(dtype))
            parts_v.append(sv.astype(dtype))
        if centre:
            compressed_k = self._dequantized(self.compressed_keys, self.config.key_params, dtype)
            compressed_v = self._dequantized(self.compressed_values, self.config.value_params, dtype)
        else:
            compressed_k, compressed_v = self.decoded(dtype)
        parts_k += [compressed_k, centred(dense_k).astype(dtype)]
        parts_v += [compressed_v, dense_v.astype(dtype)]
        return mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)

    def _chunk_mask(self, bounds: list[int], start_q: int, r0: int, r1: int, fresh: _Fresh, dtype,
                    user_mask=None, user_cols=None) -> tuple[int, mx.array]:
        """``(end, mask)`` for query rows ``r0 .. r1`` of a chunk over :meth:`_chunk_keys`' columns: ``end`` the
        columns they may see at all (none past the last row's position), ``mask`` the additive
        :func:`kvq.cache.prefill.chunk_mask` ``[r1 - r0, end]`` in ``dtype``."""
        n_sinks, n_compressed = self.sinks.length, self.compressed_keys.length
        first = n_sinks + fresh.compressed  # position of the first dense column
        end = n_sinks + n_compressed + min(start_q + r1 - first, fresh.dense[0].shape[2])
        return end, chunk_mask(bounds, start_q, r0, r1, n_sinks, n_compressed, first, end, dtype, user_mask,
                               user_cols)

    def _chunk_parts(self, queries, scale, start_q, user_mask, fresh: _Fresh) -> list:
        """Attention parts of a chunk's queries (positions ``start_q ...``), each query seeing what it would see
        in a token-by-token run: the sinks before it, the tokens compressed by then (from the compressed store,
        masked per row), and the rest up to itself uncompressed (``fresh.dense``, in slices of
        :attr:`CHUNK_ROWS` rows whose keys span only what those rows may see). ``[(out, lse)]``."""
        Tq = queries.shape[2]
        positions = range(start_q, start_q + Tq)
        bounds = self._visible(fresh, start_q, Tq)
        q_pos = mx.arange(start_q, start_q + Tq)
        parts = []
        n_sinks = self.sinks.length
        if n_sinks:
            parts.append(self._attend_part("sinks", queries, scale,
                                           self._part_mask(q_pos, start_q, 0, n_sinks, user_mask)))
        n_compressed = self.compressed_keys.length
        if n_compressed and bounds[-1]:
            mask = None
            if bounds[0] < n_compressed:
                mask = mx.arange(n_compressed)[None] < mx.array(bounds)[:, None]
            if user_mask is not None:
                window = user_mask[..., n_sinks : n_sinks + n_compressed]
                mask = window if mask is None else mask & window
            keys, values = self.compressed_keys.view(), self.compressed_values.view()
            parts.append(self._uncentre(self._attend_fn(keys, queries)(queries, keys, values, scale, mask), queries,
                                        scale))
        dense_k, dense_v = fresh.dense
        first = n_sinks + fresh.compressed  # position of the first uncompressed token after the sinks
        outs, lses = [], []
        for r0 in range(0, Tq, self.CHUNK_ROWS):
            r1 = min(Tq, r0 + self.CHUNK_ROWS)
            lo = bounds[r0] - fresh.compressed
            hi = min(positions[r1 - 1] - first + 1, dense_k.shape[2])
            rows = queries[:, :, r0:r1]
            if hi <= lo:
                outs.append(mx.zeros(rows.shape[:3] + (dense_v.shape[-1],), mx.float32))
                lses.append(mx.full(rows.shape[:3], float("-inf"), mx.float32))
                continue
            key_pos = mx.arange(first + lo, first + hi)[None]
            row_pos = q_pos[r0:r1, None]
            mask = (key_pos >= n_sinks + mx.array(bounds[r0:r1])[:, None]) & (key_pos <= row_pos)
            if user_mask is not None:
                rows_mask = user_mask[..., r0:r1, :] if user_mask.shape[-2] > 1 else user_mask
                mask = mask & rows_mask[..., first + lo : first + hi]
            out, lse = dense_attend(rows, dense_k[:, :, lo:hi], dense_v[:, :, lo:hi], scale, mask)
            outs.append(out)
            lses.append(lse)
        parts.append((mx.concatenate(outs, axis=2), mx.concatenate(lses, axis=2)))
        return parts

    def _fused_attend(self, queries, scale):
        """Decode of one token in one fused call over the compressed tokens, the sinks and the window, where the
        chosen attend implementation offers it; ``None`` otherwise (the parts are attended and merged).

        The hot path of decode: bound once (:meth:`_bind`) and replayed while the compressed tokens (the store's
        view object), the queries' shape and dtype, the scale and the installed plugins stay the same, so a step
        is one slice of the window and one launch (:class:`kvq.contract.BindsDense`; kvq_metal's
        :class:`~kvq_metal.attend.DecodeStep`). Implementations with only ``attend_dense``
        (:class:`kvq.contract.AttendsDense`) are called through it every step."""
        keys = self.compressed_keys.view()
        n = self.window.length
        if keys is None or not n:
            return None
        bound = self._bound
        signature = (queries.shape, queries.dtype, scale, registry().generation)
        if bound is None or bound[0] is not keys or bound[1] != signature:
            bound = self._bound = (keys, signature, self._bind(queries, scale, keys))
        step = bound[2]
        if step is None:
            return None
        window = self.window
        # a centred layer scores its sinks and window from centred keys too: every score then lacks the same
        # scale * q . mu, which the softmax does not see
        return step(queries, self._centred_dense(window.keys[:, :, :n]), window.values[:, :, :n])

    def _bind(self, queries, scale, keys):
        """The decode step of :meth:`_fused_attend` for these compressed ``keys``: the implementation's bound step
        (:class:`kvq.contract.BindsDense`), else a call of its ``attend_dense`` per step, else ``None``."""
        if not self._own_attend():
            return None
        values = self.compressed_values.view()
        choice = self._attend_plan(keys, queries).choices.get("attend")
        if choice is None:
            return None
        sink_keys, sink_values = self.sinks.view()
        sink_keys = self._centred_dense(sink_keys)
        window_keys, window_values = self.window.view()
        bind = optional_hook(choice.implementation, BindsDense)
        if bind is not None:
            step = bind(queries, keys, values, scale, sink_keys, sink_values, window_keys, window_values)
            if step is not None:
                return step
        attend_dense = optional_hook(choice.implementation, AttendsDense)
        if attend_dense is None:
            return None

        def step(q, wk, wv):
            result = attend_dense(q, keys, values, scale, DenseTokens(sink_keys, sink_values, wk, wv))
            return None if result is None else result[0].astype(q.dtype)

        return step

    def _parts(self):
        return [(k, n) for k, n in (("sinks", self.sinks.length), ("compressed", self.compressed_keys.length),
                                    ("window", self.window.length)) if n]

    def _part_mask(self, q_pos, first_query, start, length, user_mask):
        if user_mask is None and start + length - 1 <= first_query:
            return None  # every key of this part precedes every query
        mask = q_pos[:, None] >= mx.arange(start, start + length)[None]
        if user_mask is not None:
            mask = mask & user_mask[..., start : start + length]
        return mask

    def _attend_part(self, kind, queries, scale, mask):
        if kind != "compressed":  # sinks or window: uncompressed
            keys, values = (self.sinks if kind == "sinks" else self.window).view()
            return dense_attend(queries, keys, values, scale, mask)
        keys, values = self.compressed_keys.view(), self.compressed_values.view()
        return self._uncentre(self._attend_fn(keys, queries)(queries, keys, values, scale, mask), queries, scale)

    def _attend_plan(self, keys, queries):
        """:func:`kvq.select`'s plan for attending ``queries`` over the compressed ``keys`` (one method)."""
        kp = self.config.key_params
        B, Hq, Tq, _ = queries.shape
        return select(kp.method, keys.shape, dtype=queries.dtype, op="attend", params=kp, num_queries=Tq,
                      num_q_heads=Hq, kernels=attend_kernels(self.config.kernels, Tq))

    def _own_attend(self) -> bool:
        """Whether the keys' method attends the compressed tokens itself (``kvq_attend``): keys and values of one
        method, or keys of a keys-only method (``qjl``), whose attention takes values of any method (its fused
        kernel reads some of them: ``qjl`` keys with ``affine`` values)."""
        kp, vp = self.config.key_params, self.config.value_params
        if not has_attend(kp.method):
            return False
        return kp.method == vp.method or registry().method(kp.method).keys_only

    def _attend_fn(self, keys, queries):
        """The attention over the compressed tokens: the method's own ``kvq_attend`` chosen by :func:`kvq.select`;
        otherwise (two methods, or a method that only quantizes and dequantizes, like the example plugin) each
        side's pure-MLX block protocol or its ``kvq_dequantize``, one block at a time
        (:func:`kvq.attention.attend_encoded`)."""
        if self._own_attend():
            return self._attend_plan(keys, queries).attend
        kp, vp = self.config.key_params, self.config.value_params
        k_impl, v_impl = block_implementation(kp.method, "keys"), block_implementation(vp.method, "values")
        return lambda q, k, v, s, m: attend_encoded(q, k, v, s, m, k_impl, v_impl)

    # -- mlx-lm cache protocol ------------------------------------------------------------------------
    def __deepcopy__(self, memo):
        """A copy that shares nothing mutable (``mx.Dtype`` cannot be pickled, so every one the cache's tuples hold
        is passed through: a cache loaded from a file and then updated held two distinct dtype objects, and its
        copy, which mlx-lm's server makes of every cache it reuses, raised ``cannot pickle 'Dtype' object``)."""
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
        return n

    @classmethod
    def merge(cls, caches):
        """mlx-lm's batching hook: a :class:`BatchKVQCache` of copies of ``caches``."""
        from .batch import BatchKVQCache

        return BatchKVQCache.merge(caches)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """mlx-lm's mask hook: kvq enforces causality from positions, so only sliding windows are refused (a
        sliding-window layer gets a :class:`kvq.cache.RotatingKVQCache`)."""
        if window_size is not None:
            raise ValueError("a KVQCache serves full-attention layers, not a sliding window (window_size); "
                             "kvq.make_prompt_cache gives sliding-window layers a RotatingKVQCache")
        return None if N == 1 else "causal"

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "KVQCache":
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
        kp, vp = self.config.key_params, self.config.value_params
        head_dims = (None, None) if self._layout is None else self._layout[2:4]
        if all(p.method == "affine" and (p.bits, _group_size(p, d)) == (bits, group_size)
               for p, d in zip((kp, vp), head_dims)):
            return self
        raise ValueError(
            f"kv_bits={bits} (kv_group_size={group_size}) asks mlx-lm to quantize a kvq cache that already "
            f"compresses its keys with {kp!r} and its values with {vp!r}; kvq does not quantize compressed tokens a "
            f"second time. Leave kv_bits out to keep kvq's compression, or make kvq caches that hold what kv_bits "
            f"asks for, which it then accepts: kvq.patch_model(model, 'affine', bits={bits}, "
            f"group_size={group_size}) (or kvq.make_prompt_cache with the same arguments)")

    # -- prompt-cache files ---------------------------------------------------------------------------
    @property
    def state(self) -> dict:
        """Everything needed to rebuild this cache, for ``mlx_lm.models.cache.save_prompt_cache``: the compressed form.

        A dict of arrays (compressed fields trimmed to the stored length; ``key_mean``, float32 ``[B, H, 1, D_k]``,
        for a centred layer only), ints and one JSON string holding the configuration, the layout, the
        kvq version and the file-format version.
        """
        keys, values = self.compressed_keys.view(), self.compressed_values.view()
        centred = {} if self.key_mean is None else {"key_mean": self.key_mean}
        return {
            **centred,
            "config": config_to_json(self.config, self._layout),
            "offset": self.offset,
            "sink_keys": self.sink_keys, "sink_values": self.sink_values,
            "window_keys": self.window_keys, "window_values": self.window_values,
            "keys": {} if keys is None else dict(keys.data),
            "values": {} if values is None else dict(values.data),
        }

    @classmethod
    def from_state(cls, state: dict) -> "KVQCache":
        """Rebuild a cache from :attr:`state` (what ``mlx_lm.models.cache.load_prompt_cache`` calls), and patch
        mlx-lm's attention (:mod:`kvq.cache.patch`) so that a model loaded before uses it.

        A state saved by :func:`kvq.save_prompt_cache` holds its checksum, verified here first; a state without one
        (saved with mlx-lm's ``save_prompt_cache``, or before kvq wrote checksums) is rebuilt unchecked.

        :raises ValueError: a state that does not match its checksum (a corrupt file), a file of another format
            version, or of a method that is not installed, or inconsistent contents; the message says which.
        """
        check_layer(state)
        config, layout = config_from_json(state["config"])
        cache = cls._empty_for_state(config, state)
        cache._layout = layout
        cache.offset = int(state["offset"])
        mean = state.get("key_mean")
        if mean is not None and mean.size:
            want = None if layout is None else (layout[0], layout[1], 1, layout[2])
            if want is None or tuple(mean.shape) != want or mean.dtype != mx.float32:
                raise ValueError(f"prompt cache: key_mean of shape {tuple(mean.shape)} ({mean.dtype}) does not fit the "
                                 f"layout {want} (float32); the file is inconsistent")
            cache._set_key_mean(mean)
        for buffer, name in ((cache.sinks, "sink"), (cache.window, "window")):
            if state.get(f"{name}_keys") is not None:
                buffer.replace(state[f"{name}_keys"], state[f"{name}_values"])
        head_dims = (None, None) if layout is None else (layout[2], layout[3])
        for store, name, params, head_dim in ((cache.compressed_keys, "keys", config.key_params, head_dims[0]),
                                              (cache.compressed_values, "values", config.value_params,
                                               head_dims[1])):
            if state.get(name):
                store.append(Encoded(params, dict(state[name]), head_dim))
        cache._check_restored(state)
        from . import patch  # (patch imports this module)

        patch.patch()  # mlx-lm's loader gives no other moment: without it attention would get the stand-ins
        return cache

    @classmethod
    def _empty_for_state(cls, config: CacheConfig, state: dict) -> "KVQCache":
        """The empty cache :meth:`from_state` fills (a subclass reads its own entries of ``state`` here)."""
        return cls(config)

    def _check_restored(self, state: dict) -> None:
        """:raises ValueError: the tokens :meth:`from_state` restored do not add up to ``offset``."""
        stored = self.sinks.length + self.window.length + self.compressed_keys.length
        if stored != self.offset:
            raise ValueError(f"prompt cache: {stored} tokens stored but offset is {self.offset}; the file is "
                             f"inconsistent")

    @property
    def nbytes(self) -> int:
        """Bytes resident: sinks, window, the allocated compressed store (codes and side data) and a centred
        layer's key mean."""
        return self.sinks.nbytes + self.window.nbytes + self.compressed_keys.nbytes + \
            self.compressed_values.nbytes + (0 if self.key_mean is None else self.key_mean.nbytes)


def _group_size(params, head_dim: int | None):
    """The group size affine ``params`` quantize ``head_dim``-wide vectors with: their ``group_size``, or where that
    is left to be chosen from head_dim (``None``), the choice (``group_size_for``) once head_dim is known."""
    choose = getattr(params, "group_size_for", None)
    if params.group_size is None and choose is not None and head_dim is not None:
        return choose(head_dim)
    return params.group_size


def _bool_mask(mask):
    """mlx-lm's mask as a boolean array (True = may attend), or None for ``None``/``"causal"``."""
    if mask is None or isinstance(mask, str):
        return None
    if mask.dtype == mx.bool_:
        return mask
    return mask > mx.finfo(mask.dtype).min / 2  # additive mask: large negative = masked
