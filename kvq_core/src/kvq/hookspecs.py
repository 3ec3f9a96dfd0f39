"""The kvq plugin contract: pluggy hook specifications.

Two kinds of plugin objects meet kvq's :class:`pluggy.PluginManager`:

* An **entry-point module** (group ``kvq``) implements :func:`kvq_register`. kvq calls it once, with a
  ``register`` callback, and the module hands over its :class:`kvq.Method` declarations and its
  implementation objects (the style of simonw/llm's ``register_models``).
* An **implementation object** serves one ``(method, backend)``. It implements some or all of the four op
  hooks below, plus two plain methods that are not hooks: ``supports(problem) -> bool`` and
  ``cost(problem) -> float`` (estimated seconds). Registering it makes pluggy check every hook's argument
  names against these specs.

Everything else kvq reads from these objects and from a method's parameters (``explain``, ``attend_dense``, the
block protocol ``prepare_queries``/``scores``/``weighted_values``/``finish_values``, ``for_layer``, ``fit`` ...)
is specified, with these hooks' exact signatures, in :mod:`kvq.contract`.

Shapes follow docs/DESIGN.md, "Vocabulary": keys and values ``[B, H_kv, T, D]``, queries ``[B, H_q, T_q, D]``
with ``H_q % H_kv == 0``. Every array in an :class:`kvq.Encoded` has the token axis at position 2, so a cache can
slice, preallocate and concatenate encodings without knowing the method.

Hooks are never called by broadcast on the hot path: :func:`kvq.select` picks one implementation per op and
returns its bound method (``kvq select METHOD --shape ...`` prints that choice and why). A broadcast call runs a
hook on every registered implementation and returns their results in a list, for parity checks:
``kvq.plugin_manager().hook.kvq_pack(codes=codes, bits=3)`` (keyword arguments only). The parity tests
(``tests/test_kernels_gpu.py``) instead take a kernel implementation and the pure-MLX one of the same method from
``kvq.registry().implementations`` and compare them. Do not use ``firstresult`` to pick an implementation: it
picks by registration order.
"""

from __future__ import annotations

import pluggy

PROJECT = "kvq"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: The op names, in the order that ``kvq list`` and plans show them.
OPS = ("quantize", "dequantize", "attend", "pack")


@hookspec
def kvq_register(register):
    """Hand kvq this plugin's methods and implementations (called once per entry point).

    :param register: ``register(obj)``: call it with each :class:`kvq.Method` declaration and each
        implementation object. Names are owned by kvq: registering a method name twice, or the same
        ``(method, backend)`` twice, raises :class:`kvq.RegistrationError`.
    :return: ignored.
    """


@hookspec
def kvq_quantize(x, params):
    """Encode a block of keys or values.

    :param x: ``mx.array`` of shape ``[B, H_kv, T, D]``, float16, bfloat16 or float32.
    :param params: the method's frozen parameter object (an instance of ``Method.params_class``).
    :return: :class:`kvq.Encoded` holding the packed codes and per-token side data (norms, scales), every
        array shaped ``[B, H_kv, T, ...]``. Raises ``ValueError``/``TypeError`` naming the argument on bad
        input (wrong rank, non-float dtype, a head_dim the method does not support).
    """


@hookspec
def kvq_dequantize(encoded, dtype):
    """Decode an :class:`kvq.Encoded` back to ``[B, H_kv, T, D]``.

    :param encoded: what ``kvq_quantize`` returned (possibly sliced along the token axis).
    :param dtype: the ``mx.Dtype`` of the result (the dtype of the original input, usually).
    :return: ``x_hat``, ``mx.array`` ``[B, H_kv, T, D]`` of ``dtype``. For sketch methods (QJL) this is an
        estimate; their docstrings say so.
    """


@hookspec
def kvq_attend(queries, keys, values, scale, mask):
    """Attention of queries over compressed keys and values, never materialising fp16 K/V for all tokens.

    :param queries: ``[B, H_q, T_q, D]`` float array, not yet scaled.
    :param keys: :class:`kvq.Encoded` for ``[B, H_kv, T, D]`` keys (``T`` may be 0).
    :param values: :class:`kvq.Encoded` for ``[B, H_kv, T, D_v]`` values.
    :param scale: float multiplying ``q . k`` (usually ``D ** -0.5``).
    :param mask: ``None`` (every query sees every key), ``"causal"`` (the queries are the last ``T_q`` of the
        ``T`` positions), or a boolean ``mx.array`` broadcastable to ``[B, H_q, T_q, T]`` where ``True`` means
        "may attend".
    :return: ``(out, lse)``: ``out`` float32 ``[B, H_q, T_q, D_v]`` normalised over these keys, and ``lse``
        float32 ``[B, H_q, T_q]``, the natural-log log-sum-exp of the scaled, masked scores (``-inf`` and
        ``out = 0`` for a query that sees no key). Parts are merged by :func:`kvq.attention.merge_parts`.
    """


@hookspec
def kvq_pack(codes, bits):
    """Pack integer codes densely into uint32 words along the last axis (b-bit codes cost b bits).

    :param codes: unsigned integer ``mx.array`` ``[..., N]`` with values below ``2**bits``.
    :param bits: code width, 1..16.
    :return: uint32 ``[..., ceil(N * bits / 32)]``; a code may straddle two words.
    """


@hookspec
def kvq_unpack(packed, bits, count):
    """Inverse of :func:`kvq_pack`.

    :param packed: uint32 ``[..., W]`` from ``kvq_pack``.
    :param bits: code width used when packing.
    :param count: ``N``, the number of codes per row.
    :return: uint32 ``[..., N]`` codes.
    """
