"""Fused decode attention over *code streams*: the kernel of the methods whose keys are not one table lookup per
coordinate (QJL, TurboQuant-Prod, VecInfer).

:mod:`kvq_metal.attend` serves codes that decode as ``x_j = table[code_j] * scale + bias`` in the queries' own
domain. The methods here need more: QJL scores a key from ``m`` sign bits against the *sketched* query ``S q``
(``m`` ≠ head_dim) and adds an outlier-channel estimate; TurboQuant-Prod scores the sum of an MSE stage (rotated
query) and a sign sketch of its residual (sketched rotated query), and accumulates values in both domains;
VecInfer's codes index sub-vector centroids. One description covers them all:

* the method *prepares* the queries once per call (pure MLX, a few small ops: :func:`attend_streams` takes the
  function): float32 ``[B, H_kv, n_rep, T_q, DQ]``, every domain a key stream reads side by side;
* a key's score is ``Σ_streams scale_t · Σ_j q'[offset + j] · table[code_tj]`` (one or two :class:`Stream`),
  plus optionally QJL's outlier term (:class:`Outliers`);
* a value is one or two value streams written side by side (``DO`` coordinates), and the method *finishes* the
  normalised output once (inverse rotation, ``Sᵀ`` of a sketch-domain sum).

No key or value is ever decoded to memory: every code is read once from the cache's packed words (uint32) or
bytes (uint8: QJL's signs), in place. Layout: as the SIMT kernel of :mod:`kvq_metal.attend` (flash-decoding,
Dao et al. 2023): one thread group of 128 threads per (batch, KV head, split of the sequence), ``NCG`` threads per
token, per tile an online softmax, the splits merged by log-sum-exp (``decode_merge_streams.kvq``, which applies
the method's linear finish before the sinks' and window's blocks are added). Kernel text:
``kvq_metal/kernels/decode_attend_streams.kvq``; pure-MLX reference :func:`kvq_metal.reference.decode_attend_streams`.

On CUDA the calls :func:`kvq_metal.streams_plan.tc_plan` takes (qjl keys with affine values, turboquant_prod: scalar
codes of 1-8 bits)
run the same contract on tensor cores instead (``decode_attend_streams_tc.cu``, the layout of
:mod:`kvq_metal.attend_tc`: per key stream ``K_X · Q_Xᵀ`` with the keys as the A operand and the stream's per-token
scales applied to its fp32 result, per value stream ``V_Xᵀ · P_Xᵀ``; 1-bit streams decoded four coordinates per
lookup of a nibble table; QJL's outlier estimate in SIMT beside it), merged by the same merge kernel. Measured on
an H200 at 128K tokens: 2.2-2.5x faster than the SIMT version (``benchmarks/results/streams/README.md``).

Memory: nothing above the cache but the prepared queries, the per-split partial outputs (``splits · R · DO``
floats per KV head, at most :data:`~kvq_metal.attend.MAX_SPLITS` splits) and the output.
"""

from __future__ import annotations

from typing import Callable

import attrs
import mlx.core as mx
from kvq.attention import DenseTokens

from .attend import DENSE_DTYPES, MAX_SPLITS, THREADS, _constant, _dense_key, splits_for
from .common import grouped_rows
from .dialect import float_bits
from .kernel_files import KERNELS, load
from .knobs import StreamsKnobs
from .step import DecodeStep, KernelCall, aliases, dense_inputs
from . import streams_plan
from .streams_plan import MAX_TABLE, TC_SHARED_WORDS  # noqa: F401 - the plugins' and tests' names for them

DECODE_ATTEND_STREAMS = load(KERNELS / "decode_attend_streams.kvq")
DECODE_MERGE_STREAMS = load(KERNELS / "decode_merge_streams.kvq")
#: The tensor-core version (CUDA only): :func:`kvq_metal.streams_plan.tc_plan` says which calls it takes.
DECODE_ATTEND_STREAMS_TC = load(KERNELS / "decode_attend_streams_tc.cu",
                                header=KERNELS / "decode_attend_streams_tc.cuh")

INPUTS = ("q", "kc", "ka_s1", "ka_s2", "ka_t", "kb_c", "kb_s1", "kb_s2", "kb_t", "o_i", "o_c", "o_s", "o_m",
          "vc", "va_s1", "va_s2", "va_b", "va_t", "vb_c", "vb_s1", "vb_s2", "vb_t", "qr", "wk", "wv", "sk", "sv")
MERGE_INPUTS = ("part", "ml", "fin")
#: The launch knobs this module plans with (:class:`kvq_metal.knobs.StreamsKnobs`, frozen; read at each plan, so a
#: benchmark may swap the object: ``benchmarks/knobs.py``).
TUNING = StreamsKnobs()
@attrs.frozen(eq=False)
class Stream:
    """One stream of codes, as the kernel reads it: coordinate ``j`` of a token is
    ``table[head][code_{j // vec}][j % vec] * scale_{j // group} + bias_{j // group}``.

    :param codes: uint32 words or uint8 bytes ``[B, H_kv, T, W]``: ``dim / vec`` codes of ``bits`` bits packed
        densely, little-endian, per token (a strided view of a cache's buffer: read in place). The last axis must
        be contiguous.
    :param dim: coordinates per token. :param bits: 1..12 bits per code. :param vec: coordinates a code decodes to
        (1: a scalar table; VecInfer's ``sub_dim``).
    :param table: float32 ``[G, 2**bits * vec]`` (``G`` = 1, or one table per KV head), at most :data:`MAX_TABLE`
        entries per head.
    :param scales: up to two per-token factors multiplied together: float arrays ``[B, H_kv, T]``; the first may
        instead be ``[B, H_kv, T, dim // group]`` (one per group, values only).
    :param biases: like a grouped first scale, or ``None`` (values only).
    :param group: coordinates per scale and bias (``dim``: one per token).
    :param offset: keys: where this stream's coordinates start in the prepared query row.
    :param reserved: the token whose codes are all ``2**bits - 1`` is non-finite (VecInfer's reserved pattern):
        its score is NaN, and its value weighs NaN into every output, as a NaN token does in an fp16 cache.
    """

    codes: mx.array
    dim: int
    bits: int
    table: mx.array
    vec: int = 1
    scales: tuple = ()
    biases: mx.array | None = None
    group: int | None = None
    offset: int = 0
    reserved: bool = False

    @property
    def group_size(self) -> int:
        """Coordinates per scale and bias (``group``, or ``dim``: one per token)."""
        return self.group or self.dim

    @property
    def code_bytes(self) -> int:
        """Bytes of one element of ``codes``: 1 (uint8 bytes) or 4 (uint32 words)."""
        return 1 if self.codes.dtype == mx.uint8 else 4


@attrs.frozen(eq=False)
class Outliers:
    """QJL's outlier channels (Zandieh, Daliri, Han, arXiv 2406.03482): each token adds
    ``Σ_i q[offset + idx_i] · ‖k_out‖ · (sketch ᵀ sign)_i`` to its score.

    :param indices: uint8 ``[B, H_kv, T, k]``: the token's outlier channels (head_dim <= 256).
    :param signs: uint8 ``[B, H_kv, T, m_o / 8]``: the sign bits of ``S_o k_out``, 8 per byte little-endian.
    :param norms: ``[B, H_kv, T]`` float: ``‖k_out‖``.
    :param sketch: float32 ``[m_o, k]``: ``S_o`` times its estimator constant ``c_o / m_o``.
    :param offset: where the unsketched query starts in the prepared query row.
    """

    indices: mx.array
    signs: mx.array
    norms: mx.array
    sketch: mx.array
    offset: int = 0


@attrs.frozen(eq=False)
class StreamCall:
    """A method's decode attention as :func:`decode_attend_streams` reads it: one or two key streams (their scores
    add), optional :class:`Outliers`, one or two value streams (written side by side: the output has
    ``sum(v.dim for v in values)`` coordinates), and ``query_dim``, the width of the prepared query row."""

    keys: tuple
    values: tuple
    query_dim: int
    outliers: Outliers | None = None

    @property
    def out_dim(self) -> int:
        """``DO``: the value streams' coordinates side by side (the kernel's output row before the finish)."""
        return sum(v.dim for v in self.values)


def _stream_key(s: Stream, side: str) -> tuple:
    scaled = len(s.scales)
    return (s.dim, s.bits, s.vec, scaled, s.code_bytes, s.table.shape[0] > 1, s.reserved, s.offset,
            s.group_size if side == "values" else s.dim, s.biases is not None)


def _signature(call: StreamCall, rows: int, dense: tuple = (0, False, 0, 0)) -> tuple:
    """The static signature of a launch: rows, query width, each stream's widths and flags, the outliers' sizes,
    ``dense`` = (ND, sinks present, raw head_dim, softmax scale's float bits) and the tuning knobs."""
    o = call.outliers
    outliers = None if o is None else (o.indices.shape[-1], o.signs.shape[-1] * 8, o.offset)
    return (rows, call.query_dim, tuple(_stream_key(s, "keys") for s in call.keys),
            tuple(_stream_key(s, "values") for s in call.values), outliers, dense, TUNING.kt,
            TUNING.registers)


def supported(call: StreamCall, rows: int, head_dim: int | None = None) -> bool:
    """Whether :func:`decode_attend_streams` serves ``call`` with ``rows = n_rep * T_q`` query rows per KV head
    (:func:`kvq_metal.streams_plan.plan` says why not); with ``head_dim``, also with a cache's uncompressed tokens
    of that head_dim in the same launch."""
    dense = (0, False, 0, 0) if head_dim is None else (2, True, head_dim, 0)
    return streams_plan.plan(_signature(call, rows, dense))[0] is not None


def explain(call: StreamCall, rows: int, head_dim: int | None = None) -> str:
    """Why :func:`decode_attend_streams` does not serve ``call`` (empty when it does; ``head_dim`` as
    :func:`supported`)."""
    dense = (0, False, 0, 0) if head_dim is None else (2, True, head_dim, 0)
    return streams_plan.plan(_signature(call, rows, dense))[1]


def _arrays(call: StreamCall) -> list:
    """The kernel's code inputs after the queries (:data:`INPUTS` up to ``vb_t``); an absent input passes an array
    of the same rank that the kernel never reads."""
    ka, va = call.keys[0], call.values[0]
    kb = call.keys[1] if len(call.keys) > 1 else ka
    vb = call.values[1] if len(call.values) > 1 else va

    def scale(s: Stream, i: int, fallback: mx.array) -> mx.array:
        return s.scales[i] if len(s.scales) > i else fallback

    tokens = ka.codes[..., 0]  # [B, H, T]: stands in for absent per-token arrays (never read)
    o = call.outliers
    outlier = [ka.codes, ka.codes, tokens, _constant((0.0,), mx.float32)] if o is None else \
        [o.indices, o.signs, o.norms, o.sketch]
    return [ka.codes, scale(ka, 0, tokens), scale(ka, 1, tokens), ka.table,
            kb.codes, scale(kb, 0, tokens), scale(kb, 1, tokens), kb.table,
            *outlier,
            va.codes, scale(va, 0, tokens), scale(va, 1, tokens), va.biases if va.biases is not None else tokens,
            va.table, vb.codes, scale(vb, 0, tokens), scale(vb, 1, tokens), vb.table]


@attrs.frozen(eq=False)
class _Plan:
    """What a launch of the streams kernel and its merge keeps whatever the token count (:func:`_launch_plan`)."""

    tc: bool
    tile: int
    call: object
    template: list
    kept: tuple
    merge: object
    merge_template: list


#: :func:`_launch_plan`'s plans by signature, back end, output, input dtypes, aliases and :data:`TUNING`.
_PLANS: dict = {}


def _launch_plan(call: StreamCall, rows: int, dense: tuple, inputs: list, backend: str, out_dim: int,
                 finish: bool, per_step: tuple = ()) -> _Plan:
    """The plan of a launch (:func:`_launches`) for the call's signature (:func:`_signature`; on CUDA the tensor-core
    kernel where :func:`kvq_metal.streams_plan.tc_plan` serves it): the bound kernel (template values written into
    its text on CUDA, an input that is the same array as an earlier one read through it), the inputs it takes,
    tokens per tile and the bound merge. Made once per signature, back end, output width, finish, input dtypes, aliases and
    :data:`TUNING`: a cache binds a new decode step at every window flush of every layer, and planning and
    binding cost the host more than the launch.

    ``per_step``: the inputs a bound step passes anew each call (never aliased, :func:`kvq_metal.step.aliases`).

    :raises ValueError: a call the kernel does not serve (the message says why)."""
    same = aliases(INPUTS, inputs, per_step)
    signature = _signature(call, rows, dense)
    key = (signature, backend, out_dim, finish, tuple(a.dtype for a in inputs), tuple(sorted(same.items())),
           TUNING)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    template, why = streams_plan.plan(signature)
    if template is None:
        raise ValueError(f"decode_attend_streams does not serve this call: {why}")
    nd = dense[0]
    tc = None
    if backend == "cuda" and TUNING.tc:
        ddt = DENSE_DTYPES.get(inputs[INPUTS.index("wk")].dtype, 2) if nd else 0
        tc, _ = streams_plan.tc_plan(signature, ddt, TUNING.nt, TUNING.pf, TUNING.qsh, TUNING.rep, TUNING.minb,
                                      TUNING.slack)
    if tc is not None:
        template = tc
        tile = 16 * TUNING.nt * THREADS // 32
        kern = DECODE_ATTEND_STREAMS_TC.kernel(backend, INPUTS, ("out", "ml"), ensure_row_contiguous=False)
    else:
        tile = TUNING.kt * THREADS // dict(template)["NCG"]
        kern = DECODE_ATTEND_STREAMS.kernel(backend, INPUTS, ("out", "ml"), ensure_row_contiguous=False)
    bound, full_template, kept = kern.bound(template, inputs, same)
    merge = DECODE_MERGE_STREAMS.kernel(backend, MERGE_INPUTS, ("out", "lse"))
    merge_template = [("DO", call.out_dim), ("DV", out_dim), ("R", rows), ("ND", nd), ("FIN", finish),
                      ("MAX_SPLITS", MAX_SPLITS)]
    pad = _constant((0.0,), mx.float32)
    merge_call, merge_full, _ = merge.bound(merge_template, [pad, pad, pad])
    if len(_PLANS) > 512:
        _PLANS.clear()
    plan = _PLANS[key] = _Plan(tc is not None, tile, bound, full_template, kept, merge_call, merge_full)
    return plan


def _launches(call: StreamCall, rows: int, batch: int, num_tokens: int, dense: tuple, inputs: list, backend: str,
              out_dim: int, finish: bool, out_dtype, per_step: tuple = ()) -> tuple[_Plan, KernelCall, KernelCall]:
    """``(plan, main, merge)`` of one static launch of the streams kernel and its merge: the call's plan
    (:func:`_launch_plan`, kept across token counts) and the grids of this token count's splits; ``main`` takes the
    inputs at the plan's ``kept`` positions, ``merge`` its two outputs and the finish (the output in ``out_dtype``)."""
    plan = _launch_plan(call, rows, dense, inputs, backend, out_dim, finish, per_step)
    H = call.keys[0].codes.shape[1]
    blocks = splits_for(batch * H, num_tokens, backend, plan.tile, TUNING.groups) + dense[0]
    DO = call.out_dim
    main = KernelCall(plan.call, plan.template, (THREADS * batch * H, blocks, 1), (THREADS, 1, 1),
                      [(batch, H, blocks, rows, DO), (batch, H, blocks, rows, 2)], [mx.float32, mx.float32])
    merge = KernelCall(plan.merge, plan.merge_template, (DO * batch * H * rows, 1, 1), (DO, 1, 1),
                       [(batch, H, rows, out_dim), (batch, H, rows)], [out_dtype, mx.float32])
    return plan, main, merge


def _run(call: KernelCall, inputs: list) -> list:
    """The outputs of ``call`` launched over ``inputs``."""
    return call.call(inputs=inputs, template=call.template, grid=call.grid, threadgroup=call.threadgroup,
                     output_shapes=call.shapes, output_dtypes=call.dtypes)


def _dense_inputs(raw_queries, dense: DenseTokens | None, pad) -> list:
    """``qr, wk, wv, sk, sv``: the raw queries and the cache's window and sinks (:func:`kvq_metal.step.
    dense_inputs`), ``pad`` for all five without dense tokens."""
    if dense is None:
        return [pad, pad, pad, pad, pad]
    return [raw_queries, *dense_inputs(dense.window_keys, dense.window_values, dense.sink_keys, dense.sink_values)]


def decode_attend_streams(queries: mx.array, call: StreamCall, backend: str, *, dense: DenseTokens | None = None,
                          raw_queries: mx.array | None = None, scale: float = 1.0, finish: mx.array | None = None,
                          out_dtype=mx.float32) -> tuple[mx.array, mx.array]:
    """Attention of prepared decode queries over the streams ``call`` describes (no mask: every key precedes every
    query), and optionally a cache's uncompressed sinks and window in the same softmax. Kernels
    ``decode_attend_streams.kvq`` + ``decode_merge_streams.kvq``; reference
    :func:`kvq_metal.reference.decode_attend_streams` (same arguments and result).

    :param queries: float32 ``[B, H_kv, R, DQ]``: the prepared, scaled query rows of each KV head (``R = n_rep ·
        T_q``, GQA heads major), ``DQ = call.query_dim``.
    :param call: :class:`StreamCall` with ``T >= 1`` tokens in every stream.
    :param backend: ``"metal"`` or ``"cuda"``.
    :param dense: uncompressed tokens (:class:`kvq.attention.DenseTokens`, ``[B, H_kv, n, D]``, sinks and window
        of one dtype) attended from ``raw_queries`` ``[B, H_q, T_q, D]`` times ``scale``; their values are in the
        output's domain.
    :param finish: float32 ``[DO, DV]``: the linear map taking the value streams' domain to the output's (a
        method's inverse rotation, ``Sᵀ`` of a sketch-domain sum), applied to the compressed part before the
        uncompressed part is added; ``None``: the identity (``DV = DO``).
    :param out_dtype: the output's dtype.
    :return: ``(out [B, H_kv, R, DV] out_dtype, lse [B, H_kv, R] float32)``: the normalised output and the
        natural-log log-sum-exp of the scores.
    :raises ValueError: a call :func:`supported` rejects (the message says why), queries of another shape, or
        sinks and window of different dtypes.
    """
    B, H, R, DQ = queries.shape
    codes = call.keys[0].codes
    if codes.shape[:2] != (B, H) or DQ != call.query_dim or codes.shape[2] < 1:
        raise ValueError(f"queries {tuple(queries.shape)} do not fit codes {tuple(codes.shape)} of query width "
                         f"{call.query_dim} (need [B, H_kv, R, DQ] and at least one token)")
    pad = _constant((0.0,), mx.float32)
    key = (0, False, 0, 0)
    if dense is not None:
        _dense_key(dense.sink_keys, dense.sink_values, dense.window_keys, dense.window_values)
        key = (2, dense.sink_keys is not None, raw_queries.shape[-1], float_bits(float(scale)))
    inputs = [queries.reshape(B * H, R, DQ), *_arrays(call), *_dense_inputs(raw_queries, dense, pad)]
    out_dim = call.out_dim if finish is None else finish.shape[1]
    plan, main, merge = _launches(call, R, B, codes.shape[2], key, inputs, backend, out_dim, finish is not None,
                                  out_dtype)
    part, ml = _run(main, [inputs[i] for i in plan.kept])
    return _run(merge, [part, ml, pad if finish is None else finish])


def bind_streams(call: StreamCall, queries: mx.array, scale: float, prepare: mx.array, finish: mx.array | None,
                 backend: str, sink_keys: mx.array | None, sink_values: mx.array | None, window_keys: mx.array,
                 window_values: mx.array) -> DecodeStep:
    """A :class:`kvq_metal.step.DecodeStep` of one layer's decode attention through the streams kernel (bound by
    :meth:`StreamsKernelImpl.bind_dense`), called as ``step(queries, window_keys, window_values) -> out`` (the
    queries' dtype, ``[B, H_q, T_q, D_v]``): the queries prepared by one matmul with the method's (linear)
    preparation, one launch over the compressed tokens, the sinks and the window, and one merge that applies the
    method's (linear) finish; what :func:`decode_attend_streams` computes with ``dense=``.

    :param queries: ``[B, H_q, T_q, D]`` of the shape and dtype every step passes. :param scale: the softmax scale.
    :param prepare: float32 ``[G, D, DQ]`` (``G`` = 1 or ``H_kv``): scaled queries ``[B, H_kv, R, D] @ prepare``
        are the prepared rows. :param finish: float32 ``[DO, DV]`` or ``None``.
    :param sink_keys, sink_values: ``[B, H_kv, s, D]`` or ``None``. :param window_keys, window_values: the window
        now (its dtype is bound).
    :raises ValueError: a call the kernel does not serve.
    """
    B, Hq, Tq, D = queries.shape
    H = call.keys[0].codes.shape[1]
    R = Hq // H * Tq
    pad = _constant((0.0,), mx.float32)
    codes = _arrays(call)
    q = mx.zeros((B * H, R, call.query_dim), mx.float32)
    inputs = [q, *codes, queries, *dense_inputs(window_keys, window_values, sink_keys, sink_values)]
    key = (2, sink_keys is not None, D, float_bits(float(scale)))
    out_dim = call.out_dim if finish is None else finish.shape[1]
    plan, main, merge = _launches(call, R, B, call.keys[0].codes.shape[2], key, inputs, backend, out_dim,
                                  finish is not None, queries.dtype, per_step=("q", "qr", "wk", "wv"))
    first_sink = INPUTS.index("sk")
    # absent sinks: the window stands in, passed each step where the launch keeps every input (Metal)
    stand_in = sink_keys is None and first_sink in plan.kept
    sinks = None if stand_in else [inputs[i] for i in plan.kept if i >= first_sink]
    return DecodeStep(main, [inputs[i] for i in plan.kept if 0 < i <= len(codes)], sinks, prepare=prepare * scale,
                      rows_shape=(B, H, R, D), merge=merge, finish=pad if finish is None else finish,
                      out_shape=(B, Hq, Tq, out_dim), template_args=main.template, tensor_cores=plan.tc)


def attend_streams(queries: mx.array, scale: float, num_kv_heads: int, call: StreamCall,
                   prepare: Callable[[mx.array], mx.array], finish: Callable[[mx.array], mx.array], backend: str,
                   attend_fn=None) -> tuple[mx.array, mx.array]:
    """A method's decode attention through the streams kernel, in the shapes of the ``kvq_attend`` spec.

    :param queries: ``[B, H_q, T_q, D]`` any float dtype. :param scale: the softmax scale.
    :param prepare: scaled float32 ``[B, H_kv, n_rep, T_q, D]`` -> ``[..., call.query_dim]`` (the method's own
        query preparation, pure MLX). :param finish: normalised ``[B, H_kv, n_rep, T_q, call.out_dim]`` ->
        ``[..., D_v]`` (its inverse transforms).
    :param attend_fn: ``(rows, call) -> (out, lse)``: ``None`` for :func:`decode_attend_streams` on ``backend``,
        or the reference :func:`kvq_metal.reference.decode_attend_streams` (tests).
    :return: ``(out [B, H_q, T_q, D_v] float32, lse [B, H_q, T_q] float32)``.
    """
    B, Hq, Tq, _ = queries.shape
    q = prepare(grouped_rows(queries, num_kv_heads, scale))
    n_rep = Hq // num_kv_heads
    rows = q.reshape(B, num_kv_heads, n_rep * Tq, q.shape[-1])
    if attend_fn is None:
        out, lse = decode_attend_streams(rows, call, backend)
    else:
        out, lse = attend_fn(rows, call)
    out = finish(out.reshape(B, num_kv_heads, n_rep, Tq, call.out_dim))
    return out.reshape(B, Hq, Tq, out.shape[-1]), lse.reshape(B, Hq, Tq)

