"""Which implementation serves a layer's ops: quantize and attend kernels or pure MLX (:func:`kvq.select` under the
layer's ``kernels`` preference), the attention over its compressed tokens (the method's own ``kvq_attend``, or each
side's block protocol), and the encoding of tokens that leave the window. Used by every cache class and the packed
rows of a batch alike; nothing here keeps state beyond a memo of which methods can attend."""

from __future__ import annotations

import mlx.core as mx

from ..attention import attend_encoded
from ..contract import AttendsColumns, DequantizesInto, ScoresKeys, WeightsValues, member_name, optional_hook
from ..encoded import Encoded
from ..plugins import implemented_ops, registry
from ..selection import MAX_DECODE_QUERIES, is_kernel, select
from .config import CacheConfig


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


def attend_plan(config: CacheConfig, keys, queries):
    """:func:`kvq.select`'s plan for attending ``queries [B, H_q, T_q, D]`` over compressed ``keys`` (:class:`kvq.Encoded`
    of ``config``'s key method) under ``config.kernels``."""
    kp = config.key_params
    B, Hq, Tq, _ = queries.shape
    return select(kp.method, keys.shape, dtype=queries.dtype, op="attend", params=kp, num_queries=Tq,
                  num_q_heads=Hq, kernels=attend_kernels(config.kernels, Tq))


def own_attend(config: CacheConfig) -> bool:
    """Whether the keys' method attends the compressed tokens itself (``kvq_attend``): keys and values of one
    method, or keys of a keys-only method (``qjl``), whose attention takes values of any method (its fused
    kernel reads some of them: ``qjl`` keys with ``affine`` values)."""
    kp, vp = config.key_params, config.value_params
    if not has_attend(kp.method):
        return False
    return kp.method == vp.method or registry().method(kp.method).keys_only


def attend_fn(config: CacheConfig, keys, queries):
    """The attention over compressed tokens, ``fn(queries, keys, values, scale, mask) -> (out, lse)``: the method's
    own ``kvq_attend`` chosen by :func:`kvq.select` (:func:`attend_plan`); otherwise (two methods, or a method that
    only quantizes and dequantizes, like the example plugin) each side's pure-MLX block protocol or its
    ``kvq_dequantize``, one block at a time (:func:`kvq.attention.attend_encoded`).

    :raises ValueError: a side no installed implementation can serve (:func:`block_implementation`)."""
    if own_attend(config):
        return attend_plan(config, keys, queries).attend
    kp, vp = config.key_params, config.value_params
    k_impl, v_impl = block_implementation(kp.method, "keys"), block_implementation(vp.method, "values")
    return lambda q, k, v, s, m: attend_encoded(q, k, v, s, m, k_impl, v_impl)


def columns_attention(config: CacheConfig) -> list:
    """The chunk attentions over columns (:class:`kvq.contract.AttendsColumns`) of the layer's key method's kernel
    implementations (whatever ops they serve), in the registry's order: each serves only on its own device and
    returns ``None`` where it does not serve. None under ``kernels="off"``. The columns reach them decoded, so it
    does not matter which implementation decoded them (:func:`dequantize` may have chosen pure MLX)."""
    if config.kernels == "off":
        return []
    method = config.key_params.method
    hooks = (optional_hook(impl, AttendsColumns)
             for (m, _), impl in sorted(registry().implementations.items()) if m == method and is_kernel(impl))
    return [hook for hook in hooks if hook is not None]


def dequantize(config: CacheConfig, params, encoded: Encoded, dtype) -> mx.array:
    """``encoded`` tokens (one side of a layer, of ``params``' method) decoded to ``dtype`` ``[B, H, T, D]`` by the
    implementation :func:`kvq.select` picks for dequantize under ``config.kernels`` (a fused kernel where one
    serves)."""
    return _dequantize_plan(config, params, encoded, dtype).dequantize(encoded, dtype)


def dequantize_into(config: CacheConfig, params, encoded: Encoded, dtype, before: int, after: int) -> mx.array | None:
    """:func:`dequantize` into ``[B, H, before + T + after, D]`` with the ``before`` and ``after`` columns left for
    the caller to write (:class:`kvq.contract.DequantizesInto`): by the implementation :func:`dequantize` picks
    where it offers the hook and serves, else by the first of the method's kernel implementations whose hook
    serves (each only on its own device: ``affine`` decodes with ``mx.dequantize``, and its kernel
    implementation writes the wider buffer; under ``kernels="off"``, none); ``None`` where none serves."""
    plan = _dequantize_plan(config, params, encoded, dtype)
    choice = plan.choices.get("dequantize")
    impls = [] if choice is None else [choice.implementation]
    if config.kernels != "off":
        impls += [impl for (m, _), impl in sorted(registry().implementations.items())
                  if m == params.method and is_kernel(impl) and impl not in impls]
    for impl in impls:
        hook = optional_hook(impl, DequantizesInto)
        out = None if hook is None else hook(encoded, dtype, before, after)
        if out is not None:
            return out
    return None


def _dequantize_plan(config: CacheConfig, params, encoded: Encoded, dtype):
    return select(params.method, encoded.shape, dtype=dtype, op="dequantize", params=params,
                  kernels=quantize_kernels(params.method, config.kernels))
