"""Fused decode attention over compressed keys and values (split over the sequence, merged by log-sum-exp).

One kernel serves every stored form whose coordinate decodes as ``x_j = table[code_j] * scale_g + bias_g`` (``g``
= the group of ``j``): a :class:`Side` describes one side (keys or values) that way, whatever the method (a
codebook with one norm per vector, integer levels with a scale and bias per group, two code streams indexing a
table of sums); each method's plugin builds its Sides. Codes are read straight from the cache's packed words
(``b`` bits each, densely packed, possibly straddling words): no fp16 key or value is ever written, and each code
is read once. Optionally the codes live in a randomized-Hadamard domain (``signs``): the kernels rotate the
queries and inverse-rotate the output themselves.

Layout (FlashAttention-2 / flash-decoding, Dao et al. 2023): one thread group of 128 threads per (batch, KV head,
split of the sequence). ``D / CPT`` threads share a token (each decodes ``CPT`` consecutive coordinates from one
or two words); the rest of the group works on other tokens. Per tile of 128 tokens: partial scores are reduced
across a token's threads with SIMD shuffles, a per-row online softmax runs over the tile, and each thread
accumulates ``p * x`` for its coordinates of every query row (all ``n_rep`` query heads of a GQA group and all
query tokens share the KV head's codes). The per-split ``(out, max, sum)`` are merged with log-sum-exp by a second
kernel. On CUDA the tensor-core kernel (:mod:`kvq_metal.attend_tc`) serves most shapes and merges its splits
itself, and attends a cache's uncompressed sinks and window in the same launch. A cache's decode binds a
:class:`DecodeStep` once per layer (:func:`bind_decode`): later steps are one launch each. Kernel text:
``kvq_metal/kernels/decode_attend.kvq``, ``decode_merge.kvq``, ``zero_counters.kvq``, ``decode_attend_tc.cu``;
pure-MLX reference: :func:`kvq_metal.reference.decode_attend`.
"""

from __future__ import annotations

import math
from functools import lru_cache

import attrs
import mlx.core as mx

from kvq.attention import DenseTokens

from . import attend_tc
from .attend_tc import DENSE_DTYPES
from .dialect import float_bits
from .kernel_files import KERNELS, load
from .knobs import AttendKnobs
from .step import DecodeStep, KernelCall, aliases, dense_inputs

THREADS = 128
#: Thread groups to aim for across the sequence splits (about eight per SM on an H200; a few per Apple GPU core).
TARGET_GROUPS = {"cuda": 1056, "metal": 160}
#: Query rows (n_rep * T_q) one thread group serves.
MAX_ROWS = 8
#: Most sequence splits per (batch, KV head) row (the merge kernel keeps one weight per split in shared memory).
MAX_SPLITS = 2048
#: The launch-shape knobs this module plans with (:class:`kvq_metal.knobs.AttendKnobs`, frozen; read at each plan,
#: so a benchmark may swap the object: ``benchmarks/knobs.py``).
TUNING = AttendKnobs()

#: The kernels this module launches (kernel files in ``kvq_metal/kernels``; :mod:`kvq_metal.kernel_files`).
DECODE_ATTEND = load(KERNELS / "decode_attend.kvq")
DECODE_MERGE = load(KERNELS / "decode_merge.kvq")
ZERO_COUNTERS = load(KERNELS / "zero_counters.kvq")

INPUTS = ("q", "signs", "kc", "kc2", "ks", "kb", "kt", "vc", "vc2", "vs", "vb", "vt")
MERGE_INPUTS = ("part", "ml", "signs")


@attrs.frozen
class Side:
    """One side (keys or values) of the attention, as the kernel reads it: ``x_j = table[code_j] * scale_g +
    bias_g`` with ``g = j // group``.

    :param codes: uint32 ``[B, H_kv, T, W]``: ``D`` codes of ``bits`` bits packed densely per token (may be a
        strided view into a larger buffer: the kernel reads it in place, no copy).
    :param scales: float16/bfloat16/float32 ``[B, H_kv, T]`` (one group) or ``[B, H_kv, T, D // group]``.
    :param biases: like ``scales``, or ``None``.
    :param table: float32 ``[2**(bits + bits2)]``: the value of each code (of each ``(code << bits2) | code2``
        with a second stream).
    :param bits: 1..8. :param group: coordinates per scale (``D`` for one scale per vector).
    :param codes2: optional second code stream, uint32 ``[B, H_kv, T, W2]`` of ``bits2`` (1..4) bits per
        coordinate (two-stage residual codes: ``table[(c1 << bits2) | c2] = c1_value + c2_value``).
    :param levels: ``table`` is the integer levels ``0 .. 2**bits - 1`` (``affine``): the tensor-core kernel may
        decode the codes arithmetically (:func:`kvq_metal.attend_tc.linear`), with the same values, and then never
        reads ``table``; a plugin sets it only for such a table (it is not checked).
    """

    codes: mx.array
    scales: mx.array
    biases: mx.array | None
    table: mx.array
    bits: int
    group: int
    codes2: mx.array | None = None
    bits2: int = 0
    levels: bool = False


def coords_per_thread(bits: int) -> int:
    """Coordinates one thread decodes per token: 8 for 1-4 bits, 4 for 5-8 bits (at most 32 bits of codes;
    ``TUNING.cpt = 4`` forces 4)."""
    return 4 if bits > 4 or TUNING.cpt == 4 else 8


def supported(head_dim: int, key_bits: int, value_bits: int, key_group: int, value_group: int,
              rows: int) -> bool:
    """Whether the kernel serves this shape: ``rows = n_rep * T_q <= 8``; ``head_dim`` a power of two with 4 to
    32 threads per token (32..256 at 1-4 bits); groups that are multiples of the per-thread coordinates."""
    cpt = min(coords_per_thread(key_bits), coords_per_thread(value_bits))
    threads = head_dim // cpt if head_dim % cpt == 0 else 0
    return (1 <= rows <= MAX_ROWS and 4 <= threads <= 32 and threads & (threads - 1) == 0
            and all(1 <= b <= 8 for b in (key_bits, value_bits))
            and key_group % cpt == 0 and value_group % cpt == 0
            and head_dim % key_group == 0 and head_dim % value_group == 0)


def uses_tensor_cores(backend: str, head_dim: int, keys: Side, values: Side, rows: int) -> bool:
    """Whether :func:`decode_attend` runs the tensor-core kernel (:mod:`kvq_metal.attend_tc`) for this problem:
    on CUDA, with ``TUNING.tc`` on, for the shapes it serves (the SIMT kernel serves the rest, and Metal)."""
    return _tc_serves(backend, bool(TUNING.tc), head_dim, keys.bits, values.bits, keys.group, values.group, rows,
                      keys.bits2, values.bits2)


def _tc_serves(backend: str, tc: bool, D: int, kb: int, vb: int, kg: int, vg: int, R: int, kb2: int,
               vb2: int) -> bool:
    """:func:`uses_tensor_cores` from the widths and groups (``tc``: ``TUNING.tc``)."""
    return backend == "cuda" and tc and attend_tc.supported(D, kb, vb, kg, vg, R, kb2, vb2)


@lru_cache(maxsize=4096)
def splits_for(batch_heads: int, num_tokens: int, backend: str, tile: int, groups: int | None = None) -> int:
    """Sequence splits per (batch, KV head) row, so that about ``groups`` (default :data:`TARGET_GROUPS` of the
    back end) thread groups run: at most :data:`MAX_SPLITS` and one per ``tile`` tokens, each split whole tiles
    and none empty. The kernels take the split count from the grid and compute each split's length from it
    (:func:`split_chunk`)."""
    tiles = max(1, math.ceil(num_tokens / tile))
    groups = groups or TARGET_GROUPS.get(backend, 256)
    splits = max(1, min(tiles, MAX_SPLITS, math.ceil(groups / batch_heads)))
    return math.ceil(tiles / math.ceil(tiles / splits))


def split_chunk(num_tokens: int, splits: int, tile: int) -> int:
    """Tokens per split (the last may be shorter) as the kernels compute it (``dialect.SPLIT_INDEX``): whole
    tiles of ``tile`` tokens, ``ceil(tiles / splits)`` of them. With ``splits`` from :func:`splits_for` every
    token lies in one split and no split is empty."""
    return math.ceil(math.ceil(num_tokens / tile) / splits) * tile


_CONSTANTS: dict = {}


def _constant(values: tuple, dtype) -> mx.array:
    """A small cached array, made once: code tables of a few entries and placeholders for inputs a kernel
    variant never reads. Never a per-call scalar (see :mod:`kvq_metal.dialect`: such arrays live in managed
    memory that the host keeps rewriting)."""
    key = (values, dtype)
    if key not in _CONSTANTS:
        if len(_CONSTANTS) > 4096:
            _CONSTANTS.clear()
        _CONSTANTS[key] = mx.array(list(values), dtype)
    return _CONSTANTS[key]


def table_layout(head_dim: int, rows: int, keys: Side, values: Side) -> tuple[bool, bool, bool]:
    """``(KREP, VREP, VSAME)`` of the tensor-core kernel: which code tables get one copy per lane (a lookup then
    never conflicts on a shared-memory bank; a table of ``n`` entries takes ``128 n`` bytes) and whether values
    read the keys' table (the same table object and widths). Copies are made while they fit in the static shared
    memory left after the queries (:data:`kvq_metal.attend_tc.SHARED_WORDS`), keys first; knob ``rep`` off
    (:data:`TUNING`) turns them off. A side decoded without a table (:func:`kvq_metal.attend_tc.linear`) takes
    no copy and shares none.
    Measured on an H200 at 128K tokens (``benchmarks/kernel_durations.py``): 4-bit codes with per-vector norms
    124 us with copies, 139 without; 4-bit codes with group scales and biases 141 and 147."""
    klin, vlin = _linear(head_dim, keys, values)
    return attend_tc.table_layout(head_dim, rows, keys.bits, keys.bits2, values.bits, values.bits2,
                                  keys.table is values.table, bool(TUNING.pair), bool(TUNING.rep), bool(TUNING.qsh),
                                  klin, vlin)


def _linear(head_dim: int, keys: Side, values: Side) -> tuple[bool, bool]:
    """``(KLIN, VLIN)``: which sides the tensor-core kernel decodes without a table
    (:func:`kvq_metal.attend_tc.linear`; knob ``lin`` of :data:`TUNING`)."""
    return tuple(bool(TUNING.lin) and attend_tc.linear(s.levels, s.bits, s.bits2, s.biases is not None, s.group,
                                                       head_dim, head_dim // per)
                 for s, per in ((keys, 4), (values, 8)))


def serves_dense(backend: str, head_dim: int, keys: Side, values: Side, rows: int) -> bool:
    """Whether :func:`decode_attend` takes ``dense=``: only the tensor-core kernel reads uncompressed tokens."""
    return uses_tensor_cores(backend, head_dim, keys, values, rows)


@attrs.frozen
class DenseCall:
    """How a method's kernel implementation attends its codes with :func:`decode_attend` (or binds them with
    :func:`bind_decode`): its two :class:`Side` descriptions, the rotation's ``signs`` (or ``None``) and ``out_dim``."""

    keys: Side
    values: Side
    signs: mx.array | None = None
    out_dim: int | None = None


#: Inputs and outputs of the tensor-core kernel: the SIMT kernel's, the split counters the blocks count with
#: (zeroed before the launch) and the uncompressed window (``wk``, ``wv``) and sinks (``sk``, ``sv``) it attends
#: with ``ND = 2``; its per-block partial outputs, the merged output (in the dtype asked for) and log-sum-exp (the
#: last block per row merges), and the zeroed counters for the next launch (:class:`DecodeStep` passes them on).
#: ``lens`` (int32 ``[B, 2]``: each row's compressed and window token counts) is read by a ragged launch only
#: (:func:`bind_decode` with ``ragged=True``); other launches pass the counters in its place.
TC_INPUTS = INPUTS + ("counter", "wk", "wv", "sk", "sv", "lens")
TC_OUTPUTS = ("part", "ml", "fout", "lse", "cnt")


@attrs.frozen
class LaunchPlan:
    """What a decode-attention call does, fixed by its static signature (:func:`_launch_plan`): ``tc`` the
    tensor-core kernel (else the SIMT kernel and the merge), ``template`` the main launch's template arguments,
    ``tile`` compressed tokens per split step, ``limit`` the most blocks per row the merging block takes (tensor
    cores), ``nd`` the blocks of uncompressed tokens per row in the same launch (0 or 2), ``merge_template`` the
    SIMT path's merge."""

    tc: bool
    template: list
    tile: int
    limit: int
    nd: int = 0
    merge_template: list | None = None


@lru_cache(maxsize=1024)
def _launch_plan(D: int, R: int, kb: int, vb: int, kg: int, vg: int, kbias: bool, vbias: bool, kb2: int, vb2: int,
                 rot: bool, qscale: int, out_dim: int, same_table: bool, dense: tuple | None, backend: str,
                 tuning: AttendKnobs, lin: tuple[bool, bool] = (False, False), wide: bool = False) -> LaunchPlan:
    """The :class:`LaunchPlan` of one static signature, computed once: code widths and groups of both sides,
    ``rot`` (rotated domain), ``qscale`` (the softmax scale's float bits), ``same_table`` (keys and values hold
    the same table object), ``dense`` (``None``, or ``(sinks present, DENSE_DTYPES code)``), ``lin`` the sides
    decoded without a table (:func:`_linear`, tensor cores only), ``wide`` the call's rows alone fill the split
    target (``B * H_kv >= tuning.tc_groups``: the launch bound :func:`kvq_metal.attend_tc.minb`), ``tuning`` the knobs
    (:data:`TUNING`, part of the key, so a swapped object takes effect). A decode step then only computes its
    split count and builds the input lists.

    :raises ValueError: a shape :func:`supported` rejects, or ``dense`` where :func:`serves_dense` is false.
    """
    if not supported(D, kb, vb, kg, vg, R):
        raise ValueError(f"decode_attend does not serve head_dim {D}, bits {kb}/{vb}, groups {kg}/{vg}, {R} query "
                         "rows")
    t = tuning
    common = (("D", D), ("R", R), ("KB", kb), ("VB", vb), ("KG", kg), ("VG", vg), ("KBIAS", kbias),
              ("VBIAS", vbias), ("KB2", kb2), ("VB2", vb2), ("THREADS", THREADS), ("ROT", rot), ("QSCALE", qscale))
    if _tc_serves(backend, bool(t.tc), D, kb, vb, kg, vg, R, kb2, vb2):
        nd = 0 if dense is None else 2
        sinks, ddt = (False, 0) if dense is None else dense
        layout = attend_tc.table_layout(D, R, kb, kb2, vb, vb2, same_table, bool(t.pair), bool(t.rep),
                                        bool(t.qsh), *lin)
        template, tile = attend_tc.launch_template(common, nd, out_dim, layout, tuning, sinks, ddt, lin, wide)
        # the merging block keeps R * (splits + nd) weights in the 4 * 8 * D words its warps' outputs used
        return LaunchPlan(True, template, tile, min(MAX_SPLITS, 32 * D // R - nd), nd)
    if dense is not None:
        raise ValueError("decode_attend takes dense= with the tensor-core kernel only (see serves_dense)")
    cpt = min(coords_per_thread(kb), coords_per_thread(vb))
    kt = t.kt_small if R <= 4 else t.kt_large
    # PHASES 3: both phases (scores, then values); the kernel's text keeps the argument, the library no other value
    template = [*common, ("CPT", cpt), ("KT", kt), ("PHASES", 3)]
    merge = [("D", D), ("DV", out_dim), ("R", R), ("ROT", rot), ("MAX_SPLITS", MAX_SPLITS)]
    return LaunchPlan(False, template, kt * THREADS * cpt // D, MAX_SPLITS, 0, merge)


def _zero_counters(n: int, backend: str) -> mx.array:
    """``n`` zeroed int32 split counters (kernel ``zero_counters.kvq``; reference ``mx.zeros``): a fresh output of
    a one-block kernel each call, so no two launches (nor graph simplification) ever share them."""
    kern = ZERO_COUNTERS.kernel(backend, ("unused",), ("cnt",))
    threads = max(32, -(-n // 32) * 32)
    return kern(inputs=[_constant((0,), mx.int32)], template=[("N", n)], grid=(threads, 1, 1),
                threadgroup=(min(256, threads), 1, 1), output_shapes=[(n,)], output_dtypes=[mx.int32])[0]


def _dense_key(sink_keys, sink_values, window_keys, window_values) -> tuple[bool, int]:
    """``(sinks present, DENSE_DTYPES code)`` of a cache's uncompressed tokens, for :func:`_launch_plan`.

    :raises ValueError: the sinks and the window do not share one dtype (the kernel reads both as one)."""
    dtypes = {x.dtype for x in (sink_keys, sink_values, window_keys, window_values) if x is not None}
    if len(dtypes) > 1:
        raise ValueError(f"dense sinks and window must share one dtype (the kernel reads both as one); got "
                         f"{sorted(map(str, dtypes))}")
    return sink_keys is not None, DENSE_DTYPES.get(window_keys.dtype, 2)


def _plan_for(queries_shape, scale: float, keys: Side, values: Side, backend: str, rot: bool, out_dim: int | None,
              dense_key) -> tuple[LaunchPlan, int, int, int, int]:
    """The :class:`LaunchPlan` of a call and ``(D, T, R, out_dim)`` (``R`` query rows per KV head), after checking
    the shapes (errors as :func:`decode_attend`)."""
    B, Hq, Tq, Dq = queries_shape
    _, H, T, words = keys.codes.shape
    D = words * 32 // keys.bits
    out_dim = out_dim or D
    if values.codes.shape[2] != T or T < 1:
        raise ValueError(f"keys have {T} tokens and values {values.codes.shape[2]}; need the same count >= 1")
    if Hq % H or Dq > D or out_dim > D:
        raise ValueError(f"queries {tuple(queries_shape)} do not fit codes of {H} heads and dimension {D}")
    R = Hq // H * Tq
    plan = _launch_plan(D, R, keys.bits, values.bits, keys.group, values.group, keys.biases is not None,
                        values.biases is not None, keys.bits2, values.bits2, rot, float_bits(float(scale)), out_dim,
                        keys.table is values.table, dense_key, backend, TUNING, _linear(D, keys, values),
                        _wide(B * H))
    return plan, D, T, R, out_dim


def _code_inputs(keys: Side, values: Side, signs: mx.array) -> list:
    """The inputs after the queries that every decode-attention kernel reads (:data:`INPUTS`); a side without a
    second code stream or biases passes its codes or scales in their place (never read)."""
    return [signs, keys.codes, keys.codes if keys.codes2 is None else keys.codes2,
            keys.scales, keys.scales if keys.biases is None else keys.biases, keys.table,
            values.codes, values.codes if values.codes2 is None else values.codes2,
            values.scales, values.scales if values.biases is None else values.biases, values.table]


def _wide(rows: int) -> bool:
    """A launch whose ``rows`` (``B * H_kv``) alone fill the tensor-core kernel's split target
    (``TUNING.tc_groups``, a large batch): each row then takes two splits (:func:`_tc_geometry`) and a bound step
    the wide launch bound (:func:`kvq_metal.attend_tc.minb`)."""
    return rows >= TUNING.tc_groups


def _tc_geometry(plan: LaunchPlan, queries_shape, H: int, T: int, D: int, R: int, out_dim: int, backend: str,
                 out_dtype) -> tuple[tuple, list, list]:
    """``(grid, output shapes, output dtypes)`` of a tensor-core launch (:data:`TC_OUTPUTS`): the grid (in threads)
    holds ``B * H`` rows of the plan's blocks of uncompressed tokens (``y < nd``, started first) and splits of the
    compressed tokens; the output is written as ``[B, H_q, T_q, out_dim]`` (the kernel's row order, bh * R + r, is
    that layout) in ``out_dtype``.

    The splits aim at ``TUNING.tc_groups`` blocks *including* the uncompressed ones (the blocks an H200 holds
    at once, two per SM at this kernel's registers): counted on top, they made a second wave of 2 * B * H
    blocks that every row's merge waited for (Nsight Compute, H200, 32 query / 8 KV heads: 11 us added at 4K
    and at 32K tokens). Once the rows alone reach the target (a large batch), each row takes two splits (where it
    has two tiles), not one."""
    B, Hq, Tq, _ = queries_shape
    groups = max(B * H, min(TUNING.tc_groups, plan.limit * B * H) - plan.nd * B * H)
    if _wide(B * H):
        # the rows alone fill the target (a large batch): two splits per row, not one. At 122 sequences of 32K
        # tokens (976 rows; kernel_durations.py --batch 122, H200) the bound step took 0.93-0.94x the time of one
        # split per row, three splits 0.95-0.96x (benchmarks/results/kernels/2026-12-04-h200-durations-batch122-*)
        groups = max(groups, min(2, plan.limit) * B * H)
    splits = splits_for(B * H, T, backend, plan.tile, groups)
    blocks = splits + plan.nd
    return ((THREADS * B * H, blocks, 1),
            [(B, H, blocks, R, D), (B, H, blocks, R, 2), (B, Hq, Tq, out_dim), (B, Hq, Tq), (B * H,)],
            [mx.float32, mx.float32, out_dtype, mx.float32, mx.int32])


def decode_attend(queries: mx.array, scale: float, keys: Side, values: Side, backend: str, *,
                  signs: mx.array | None = None, out_dim: int | None = None,
                  dense: DenseTokens | None = None) -> tuple[mx.array, mx.array]:
    """Attention of decode queries over compressed keys and values (no mask: every key precedes every query).
    Kernels ``decode_attend.kvq`` + ``decode_merge.kvq``, or ``decode_attend_tc.cu`` (+ ``zero_counters.kvq``) on
    CUDA; pure-MLX reference :func:`kvq_metal.reference.decode_attend` (same arguments and result). A cache's
    decode steps use :func:`bind_decode` instead (the same kernel, one launch per step).

    :param queries: ``[B, H_q, T_q, D_q]``, any float dtype and any strides (read in place), ``D_q <= D`` where
        ``D`` is the codes' dimension (``keys.codes`` holds ``D`` codes per token; queries are zero-padded).
    :param scale: softmax scale applied to the queries.
    :param keys, values: :class:`Side` descriptions with ``T >= 1`` tokens and the same ``D``.
    :param backend: ``"metal"`` or ``"cuda"``.
    :param signs: float32 ``[D]`` ±1: the codes live in the randomized-Hadamard domain ``H diag(signs) / sqrt(D)``
        (a rotated codebook): queries are rotated and the output inverse-rotated inside the kernels. ``None``: the
        queries are already in the codes' domain and the output stays there.
    :param out_dim: output coordinates kept (the head_dim before padding; default ``D``).
    :param dense: uncompressed tokens attended in the same softmax (:class:`kvq.attention.DenseTokens`, a cache's
        sinks and window; the tensor-core kernel only, see :func:`serves_dense`): two more blocks per row of the
        same launch, merged into its output.
    :return: ``(out [B, H_q, T_q, out_dim] float32, lse [B, H_q, T_q] float32)``: normalised output and the
        natural-log log-sum-exp of the scaled scores.
    :raises ValueError: a shape :func:`supported` rejects, mismatched token counts, ``dense`` where
        :func:`serves_dense` is false, or ``dense`` sinks and window of different dtypes.
    """
    B, Hq, Tq, _ = queries.shape
    H = keys.codes.shape[1]
    dense_key = None if dense is None else _dense_key(dense.sink_keys, dense.sink_values, dense.window_keys,
                                                      dense.window_values)
    rot = signs is not None
    signs = signs if rot else _constant((0.0,), mx.float32)
    plan, D, T, R, out_dim = _plan_for(queries.shape, scale, keys, values, backend, rot, out_dim, dense_key)
    args = [queries, *_code_inputs(keys, values, signs)]

    if plan.tc:
        grid, shapes, dtypes = _tc_geometry(plan, queries.shape, H, T, D, R, out_dim, backend, mx.float32)
        kern = attend_tc.DECODE_ATTEND_TC.kernel(backend, TC_INPUTS, TC_OUTPUTS, ensure_row_contiguous=False)
        if dense is None:  # placeholders of one dtype: the uncompressed blocks' code is compiled, never run
            pad = _constant((0.0,), mx.float16)
            tokens = [pad, pad, pad, pad]
        else:
            tokens = dense_inputs(dense.window_keys, dense.window_values, dense.sink_keys, dense.sink_values)
        counter = _zero_counters(B * H, backend)
        outs = kern(inputs=args + [counter, *tokens, counter], template=plan.template,
                    grid=grid, threadgroup=(THREADS, 1, 1), output_shapes=shapes, output_dtypes=dtypes)
        return outs[2], outs[3]
    splits = splits_for(B * H, T, backend, plan.tile)
    kern = DECODE_ATTEND.kernel(backend, INPUTS, ("out", "ml"), ensure_row_contiguous=False)
    part, ml = kern(inputs=args, template=plan.template, grid=(THREADS * B * H, splits, 1),
                    threadgroup=(THREADS, 1, 1), output_shapes=[(B, H, splits, R, D), (B, H, splits, R, 2)],
                    output_dtypes=[mx.float32, mx.float32])
    merge = DECODE_MERGE.kernel(backend, MERGE_INPUTS, ("out", "lse"))
    out, lse = merge(inputs=[part, ml, signs], template=plan.merge_template,
                     grid=(D * B * H * R, 1, 1), threadgroup=(D, 1, 1),
                     output_shapes=[(B, H, R, out_dim), (B, H, R)], output_dtypes=[mx.float32, mx.float32])
    return out.reshape(B, Hq, Tq, out_dim), lse.reshape(B, Hq, Tq)


def bind_decode(queries: mx.array, scale: float, call: DenseCall, backend: str, *, sink_keys: mx.array | None,
                sink_values: mx.array | None, window_keys: mx.array, window_values: mx.array,
                ragged: bool = False) -> DecodeStep | None:
    """A :class:`kvq_metal.step.DecodeStep` for decode queries like ``queries`` over the compressed tokens ``call``
    describes (:class:`DenseCall`), a cache's sinks (``None`` when it holds none) and a window like
    ``window_keys``/``window_values`` (their dtype; sinks of the same dtype): the tensor-core kernel over the
    compressed tokens, the sinks and the window in one launch that merges its own splits, writes the output in the
    model's dtype and zeroes the next step's split counters; its output equals :func:`decode_attend`'s with
    ``dense=`` (cast). ``None`` where the tensor-core kernel does not serve the shape (the caller attends another
    way).

    ``ragged``: the step of a batch whose rows hold different numbers of tokens (a :class:`kvq.cache.
    BatchKVQCache`), called as ``step(queries, window_keys, window_values, lengths)`` with int32 ``lengths [B, 2]``
    (row ``b`` holds the first ``lengths[b, 0]`` bound compressed tokens and the first ``lengths[b, 1]`` window
    tokens; the sinks are whole); each row's output equals the plain step's for that row alone up to the order of
    float32 additions (the splits cover the longest row).

    On CUDA the launch carries no template arguments and passes each array once (:meth:`kvq_metal.dialect.Kernel.
    bound`: the plan's values are in the kernel's text, repeated inputs and absent sinks read through aliases).

    :raises ValueError: as :func:`decode_attend` (shapes, sinks and window of different dtypes).
    """
    keys, values = call.keys, call.values
    H = keys.codes.shape[1]
    dense_key = _dense_key(sink_keys, sink_values, window_keys, window_values)
    rot = call.signs is not None
    signs = call.signs if rot else _constant((0.0,), mx.float32)
    plan, D, T, R, out_dim = _plan_for(queries.shape, scale, keys, values, backend, rot, call.out_dim, dense_key)
    if not plan.tc:
        return None
    codes = _code_inputs(keys, values, signs)
    counter = _zero_counters(queries.shape[0] * H, backend)
    grid, shapes, dtypes = _tc_geometry(plan, queries.shape, H, T, D, R, out_dim, backend, queries.dtype)
    kern = attend_tc.DECODE_ATTEND_TC.kernel(backend, TC_INPUTS, TC_OUTPUTS, ensure_row_contiguous=False)
    # a plain launch passes the counters where a ragged one reads the rows' counts (never read: an alias)
    lengths = _constant((0, 0), mx.int32) if ragged else counter
    inputs = [queries, *codes, counter, *dense_inputs(window_keys, window_values, sink_keys, sink_values), lengths]
    template = [(k, ragged if k == "RAGGED" else v) for k, v in plan.template]
    per_step = ("q", "wk", "wv", "lens") if ragged else ("q", "wk", "wv")
    raw, full, kept = kern.bound(template, inputs, aliases(TC_INPUTS, inputs, per_step))
    n = len(codes)  # inputs: q, codes (1..n), counter, wk, wv, sinks (n + 4, n + 5), lens (last)
    # after the window: the sinks, and the lengths' placeholder where a launch keeps it (a ragged step passes its
    # lengths per call)
    fixed = [inputs[i] for i in kept if i > n + 3 and not (ragged and i == len(inputs) - 1)]
    main = KernelCall(raw, full, grid, (THREADS, 1, 1), shapes, dtypes)
    return DecodeStep(main, [inputs[i] for i in kept if 0 < i <= n], fixed, counter=counter, ragged=ragged,
                      template_args=template)
