"""Fused prefill attention on tensor cores (CUDA, sm_80 and later): a chunk's query rows over float16 or bfloat16
keys and values, each row seeing the columns of its own intervals, computed in the kernel (issue #51, phase 1).

Why: a prefill chunk on a GPU attends ``[sinks | compressed | dense]`` columns with per-row visibility
(:mod:`kvq.cache.parts`); through ``mx.fast.scaled_dot_product_attention`` that takes an additive mask array, and
on CUDA cuDNN's attention with a bias runs at 1.5-1.9x causal time (:mod:`kvq.cache.prefill`). Here each row
carries at most :data:`MAX_INTERVALS` column intervals (row ``r`` sees column ``c`` iff ``lo <= c < hi`` for one
of them: :func:`kvq.cache.parts.visible`) and no mask exists.

The kernel (``kvq_metal/kernels/prefill_attend_tc.cu``) is FlashAttention-2's forward pass (Dao 2023):

* a thread block of 4 warps (128 threads) takes :data:`BLOCK_ROWS` = 64 rows, 16 per warp; each warp reads its
  queries once from global memory into the ``mma.sync.m16n8k16`` A fragments and holds them in registers;
* it steps over tiles of :data:`TILE_COLUMNS` key columns (64 at head_dim 64 and 128, 32 at 256): K and V tiles
  are copied to shared memory by ``cp.async`` (V's copy overlaps the scores' product, the next K tile's the
  values' product), 16-byte chunks swizzled so ldmatrix reads are free of bank conflicts; static shared memory
  only (MLX's custom kernels here declare no dynamic shared memory): 17-18 KB per block at head_dim 64, 33-35 KB
  at 128, 25-27 KB at 256 (:attr:`Launch.shared_bytes`);
* scores ``S = Q K^T`` and ``O += P V`` run on tensor cores (16-bit in, float32 accumulators), ``P`` taken from the
  scores' accumulators as the A operand without shared memory; the online softmax runs in registers in log2 units
  (``exp2``), the sink logit joins the normaliser at the end;
* visibility: the block's rows' intervals sit in shared memory. Their union per interval slot decides which tiles
  are read at all: tiles between a layer's sinks, its compressed prefix and its causal band, and past the block's
  last row, are skipped without a load. Per tile, each row's visible columns become a 64-bit mask (a few integer
  operations per interval); a warp none of whose rows sees the tile skips its mma work, a warp whose rows see all
  of it skips the masking, and otherwise each score is kept or set to -inf by one bit test;
* head_dim 256: the float32 output accumulators of all 256 coordinates (128 registers per thread) with the query
  fragments (64) spill, so two blocks (grid z, :data:`VALUE_SLICE`) compute the same scores and each writes 128
  value coordinates: twice the score work at 256 only.

The ``wgmma`` form (template ``WG``; :class:`kvq_metal.knobs.PrefillKnobs` ``warpgroups``, used where
:func:`has_wgmma`, i.e. compute capability 9.x, and :func:`wgmma_serves` the head_dim: 64 and 128): the same
algorithm with both products on Hopper's warpgroup instructions (``wgmma.mma_async.m64n64k16``, PTX ISA 8.0). A
block is one or two warpgroups of 64 rows sharing each K/V tile; the query and probability fragments stay in
registers as the A operand (wgmma's register layout per warp is mma.sync's), and the tensor cores read K (K-major)
and V (N-major, transposed by the instruction) from shared memory through matrix descriptors, so no ``ldmatrix`` and
none of its address arithmetic runs. The tiles are stored in wgmma's 128-byte-swizzle atoms (64-column slices, 1024
bytes per 8 rows, aligned to 1024); ``cp.async`` writes are published to the tensor cores' async proxy by
``fence.proxy.async`` before the block's barrier. Each product is issued, committed and waited for before the
softmax touches its registers (no overlap of one tile's softmax with the next tile's product within a block;
co-resident blocks overlap). nvcc 13 for sm_90a: 120 registers at head_dim 64, 162-164 at 128, no spills. On one
H100 (2026-12-06, ``benchmarks/results/prefill/2026-12-06-h100-wgmma``): its parity tests pass, and the chunk of
2,048 below takes 1.46-1.54 / 4.33 ms at 8K / 32K (one warpgroup) against 1.96-2.13 / 6.01-6.27 for the
``mma.sync`` form and 1.41-1.67 / 3.73-4.05 for MLX's masked attention in the same runs: level at 8K, 12-15%
slower at 32K, so the knob stays off. Its pipelined schedule (template ``PIPE``, ``PrefillKnobs.pipeline``;
FlashAttention-3's intra-warpgroup overlap, Shah et al. 2024): K and V tiles double-buffered in dynamic shared memory
(``cuda_kernel(shared_memory=)``, 66 KB a block at head_dim 128), each tile's scores' product issued with the
previous tile's values' product so the softmax of one overlaps the other; 172-180 registers at head_dim 128, no
spills. Correct, and no faster (one H100, ``benchmarks/results/prefill/2026-12-06-h100-pipelined``: 1.61 / 4.50 ms
against 1.52 / 4.64 for the plain wgmma form): co-resident blocks already overlapped softmax and products. Leads:
tiles of 128 columns, TMA loads from a producer warp, two consumer warpgroups in turn (FlashAttention-3's other
two parts), after Nsight Compute of this form.

GQA: the ``n_rep = H_q / H_kv`` query heads that share a KV head are packed into a block's rows (row ``m`` of a
(batch, KV head) group is query row ``m // n_rep`` of head ``m % n_rep``), so one K/V tile serves every head of the
group. For long chunks this costs the same tile reads as one head per block (the block count is the same) and its
rows span fewer query positions (tighter tile skipping); for short chunks (decode-like ``T_q`` of 1 to 16) it reads
each tile ``n_rep`` times less and fills the tensor cores' 16-row tiles.

Registers per thread (nvcc 13.0, sm_90 and sm_80, ``benchmarks/investigations/nvcc_prefill.py``): 130-134 at
head_dim 64, 170-174 at 128, 211-216 at 256, no spills without a launch bound: two or three blocks of 128 threads
per SM.

Measured on one H200 (MLX 0.32.4, 2026-12-06): ``tests/test_prefill_kernel_gpu.py`` passes (23 tests: every head_dim,
both dtypes, GQA, up to 4 intervals, sinks, the cache's chunk path). Speed, one layer's chunk of 2,048 rows (32
query / 8 KV heads, head_dim 128) over 8K and 32K held tokens (``benchmarks/prefill_masks.py``, median of 5):
2.34 and 7.14 ms, against MLX's attention with the additive mask 1.45 and 3.84 ms and fp16's causal call 0.67 and
2.25 ms. So :class:`kvq_metal.knobs.PrefillKnobs` keeps it off. Nsight Compute at 8K (``--set full``): 173
registers, so 2 blocks (8 warps) per SM, 12.5% occupancy; issue slots 42% busy, no eligible warp in 56% of cycles;
the busiest pipe is the ALU (43%), not the tensor cores. Changed since, not yet measured: each k-step's fragments
loaded before its mma (the PTX had one load before each pair of mma, ``asm volatile`` keeping the written order; a
hypothesis that the final code stalled on each load, not read from SASS, which this machine cannot disassemble),
the per-score masking only in warps whose rows do not all see the whole tile (it was a select on a 64-bit shift for
every score), the scale folded into the exponent (one FFMA), and a launch-bound knob (``PrefillKnobs.minb``, e.g. 3
blocks per SM at head_dim 128, with a few bytes of spills); the ``mma.sync`` figures of the H100 run below include
them. The ``wgmma`` form above followed.

Precision: scores and the output accumulate in float32; the probabilities are rounded to the inputs' dtype for
the values' product (FlashAttention's numerics: bfloat16 probabilities carry 8 significant bits). The output is
divided by its normaliser in float32 and rounded once. :func:`reference_attend` is the float32 reference.

Inputs are read as row-contiguous arrays (MLX copies others before the launch) with 16-byte ``cp.async`` copies,
so each array's data must start on 16 bytes (MLX's allocations do; a view whose offset is not a multiple of 8
elements would not). No sequence split: a launch has ``B * H_kv * D / VALUE_SLICE[D]`` times ``ceil(n_rep * T_q /
64)`` blocks, so a very short chunk over few KV heads leaves most of a GPU idle (decode has its own kernels).
"""

from __future__ import annotations

import functools

import attrs
import mlx.core as mx
import numpy as np

from .dialect import float_bits, gpu_backend
from .kernel_files import KERNELS, load
from .knobs import PrefillKnobs

#: The knobs the library launches with (frozen defaults; benchmarks swap the object: benchmarks/knobs.py).
TUNING = PrefillKnobs()

#: The kernel and its header (kernel files in ``kvq_metal/kernels``).
PREFILL_ATTEND_TC = load(KERNELS / "prefill_attend_tc.cu", header=KERNELS / "prefill_attend_tc.cuh")
INPUTS = ("q", "k", "v", "iv", "sink")
OUTPUTS = ("out", "lse")

#: Rows (query rows x query heads of a GQA group) per thread block: 4 warps of 16 rows.
BLOCK_ROWS = 64
#: Key columns per tile, by head_dim: the K and V tiles (``columns * (head_dim + value slice) * 2`` bytes: 16 KB at
#: 64, 32 KB at 128, 24 KB at 256) fit the 48 KB of static shared memory an MLX custom kernel may declare.
TILE_COLUMNS = {64: 64, 128: 64, 256: 32}
#: Value coordinates per block, by head_dim (at 256 two blocks write 128 each: the module docstring).
VALUE_SLICE = {64: 64, 128: 128, 256: 128}
#: Most intervals per row.
MAX_INTERVALS = 4
#: The dtypes of queries, keys and values the kernel reads.
DTYPES = (mx.float16, mx.bfloat16)
#: Static shared memory a CUDA thread block may declare, bytes.
STATIC_SHARED_BYTES = 48 * 1024


def supported(head_dim: int, value_dim: int, dtype: mx.Dtype, num_intervals: int = 1) -> bool:
    """Whether the kernel serves this shape: ``head_dim`` a key of :data:`TILE_COLUMNS` (64, 128 or 256),
    ``value_dim == head_dim``, ``dtype`` float16 or bfloat16, ``1 <= num_intervals <= MAX_INTERVALS``."""
    return (head_dim in TILE_COLUMNS and value_dim == head_dim and dtype in DTYPES
            and 1 <= num_intervals <= MAX_INTERVALS)


@attrs.frozen
class Launch:
    """One launch of the kernel (:func:`launch_plan`).

    :param template: the kernel's template arguments (the inputs' dtypes are appended when it is called).
    :param grid: threads per axis, as MLX takes them: ``(blocks * threads, B * H_kv, value slices)``.
    :param threadgroup: ``(threads, 1, 1)``.
    :param output_shapes, output_dtypes: of ``out`` and ``lse``.
    :param shared_bytes: the static shared memory the kernel declares per block for this template.
    :param dynamic_bytes: the dynamic shared memory a block is launched with (the pipelined form's K and V tiles,
        two stages each, and 1024 bytes to align them; 0 for the other forms).
    """

    template: tuple
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: tuple
    output_dtypes: tuple
    shared_bytes: int
    dynamic_bytes: int = 0


def launch_plan(queries_shape: tuple, keys_shape: tuple, dtype: mx.Dtype, num_intervals: int, scale: float,
                sinks: bool, minb: int = 0, warpgroups: int = 0, pipeline: bool = False) -> Launch:
    """The launch of :func:`prefill_attend` for queries ``[B, H_q, T_q, D]`` and keys ``[B, H_kv, N, D]`` of
    ``dtype``, ``num_intervals`` intervals per row, softmax ``scale``, with or without sink logits (``sinks``). The
    arguments are assumed checked (:func:`check_inputs`).

    Template: ``D`` (head_dim), ``DV`` (value coordinates per block, :data:`VALUE_SLICE`), ``BC`` (columns per
    tile), ``BR`` (rows per block), ``P`` (intervals per row), ``SINK``, ``BF16`` (bfloat16 rather than float16
    mma), ``SCALE`` (the scale's float32 bits, :func:`kvq_metal.dialect.float_bits`: one compiled kernel per
    model's scale, no per-call scalar array), ``THREADS`` (per block), ``MINB`` (``minb``: blocks per SM the
    registers must fit, :class:`kvq_metal.knobs.PrefillKnobs`; 0: no bound), ``WG`` (the products on ``wgmma``,
    sm_90a only: ``warpgroups`` > 0 where :func:`wgmma_serves` ``D``; a block then has ``warpgroups`` x 64 rows) and
    ``PIPE`` (with ``WG`` and ``pipeline``: two-stage K/V tiles in dynamic shared memory, one tile's scores' product
    overlapped with the previous tile's softmax and values' product: the module docstring)."""
    B, Hq, Tq, D = queries_shape
    Hkv = keys_shape[1]
    wg = warpgroups > 0 and wgmma_serves(D)
    pipe = wg and bool(pipeline)
    BC, BR, DV = TILE_COLUMNS[D], BLOCK_ROWS * (warpgroups if wg else 1), VALUE_SLICE[D]
    threads = 2 * BR  # one warp per 16 rows
    rows = Hq // Hkv * Tq  # of a (batch, KV head) group: its query heads' rows
    blocks = -(-rows // BR)
    template = (("D", D), ("DV", DV), ("BC", BC), ("BR", BR), ("P", num_intervals), ("SINK", bool(sinks)),
                ("BF16", dtype == mx.bfloat16), ("SCALE", float_bits(scale)), ("THREADS", threads),
                ("MINB", int(minb)), ("WG", bool(wg)), ("PIPE", pipe))
    tiles = BC * (D + DV) * 2  # a K and a V tile, 16-bit
    # static: the tiles, the block's rows' intervals and their union (int32 pairs; with PIPE the intervals alone,
    # rounded to 16 bytes, nvcc's layout); dynamic with PIPE: two stages of both tiles from a 1024-byte boundary
    intervals = 8 * num_intervals * (BR + 1)
    shared = -(-intervals // 16) * 16 if pipe else tiles + intervals
    return Launch(template, (blocks * threads, B * Hkv, D // DV), (threads, 1, 1), ((B, Hq, Tq, D), (B, Hq, Tq)),
                  (dtype, mx.float32), shared, 2 * tiles + 1024 if pipe else 0)


def wgmma_serves(head_dim: int) -> bool:
    """Whether the ``wgmma`` form of the kernel (template ``WG``) exists for ``head_dim``: tiles of 64 columns and
    value slices of whole 64-coordinate blocks (64 and 128; 256 keeps ``mma.sync``: its tiles are 32 columns)."""
    return TILE_COLUMNS.get(head_dim) == 64 and VALUE_SLICE.get(head_dim, 0) % 64 == 0


def has_wgmma() -> bool:
    """Whether MLX's default device runs ``wgmma``: a CUDA GPU of compute capability 9.x (MLX's JIT compiles for
    ``sm_90a`` there; later architectures have no ``wgmma``)."""
    if gpu_backend() != "cuda":
        return False
    info = getattr(mx, "device_info", None)
    return info is not None and int(info().get("compute_capability_major", 0)) == 9


def check_inputs(queries, keys, values, intervals, scale, sink_logits=None) -> tuple[mx.array, mx.array | None]:
    """Check :func:`prefill_attend`'s arguments; return ``intervals`` as an int32 MLX array and ``sink_logits`` as
    float32 (or ``None``).

    :raises TypeError: an argument of the wrong type or dtype (queries not float16 or bfloat16, keys or values not
        the queries' dtype, intervals not int32, sink_logits not floating point, scale not a number).
    :raises ValueError: shapes that do not fit (see :func:`prefill_attend`), a shape :func:`supported` rejects,
        intervals not ``[T_q, P, 2]`` with ``1 <= P <= MAX_INTERVALS``, a scale that is not positive and finite
        (its float bits name the compiled kernel).
    """
    for name, x in (("queries", queries), ("keys", keys), ("values", values)):
        if not isinstance(x, mx.array):
            raise TypeError(f"{name} must be an mlx array; got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must be [B, heads, tokens, dim]; got shape {tuple(x.shape)}")
    if queries.dtype not in DTYPES:
        raise TypeError(f"queries must be float16 or bfloat16; got {queries.dtype}")
    for name, x in (("keys", keys), ("values", values)):
        if x.dtype != queries.dtype:
            raise TypeError(f"{name} must have the queries' dtype {queries.dtype}; got {x.dtype}")
    B, Hq, Tq, D = queries.shape
    _, Hkv, N, Dk = keys.shape
    if keys.shape[0] != B or Dk != D:
        raise ValueError(f"keys must be [{B}, H_kv, N, {D}] for queries {tuple(queries.shape)}; got "
                         f"{tuple(keys.shape)}")
    if tuple(values.shape[:3]) != (B, Hkv, N):
        raise ValueError(f"values must be [{B}, {Hkv}, {N}, D_v] for keys {tuple(keys.shape)}; got "
                         f"{tuple(values.shape)}")
    if Tq < 1 or N < 1:
        raise ValueError(f"queries and keys need at least one token; got T_q {Tq}, N {N}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"the query heads ({Hq}) must be a multiple of the key heads ({Hkv})")
    if B * Hkv > 65535:
        raise ValueError(f"B * H_kv must be at most 65535 (the grid's second axis); got {B * Hkv}")
    intervals = _check_intervals(intervals, Tq)
    if not supported(D, values.shape[3], queries.dtype, intervals.shape[1]):
        raise ValueError(f"head_dim must be one of {sorted(TILE_COLUMNS)} with value_dim equal to it; got head_dim "
                         f"{D}, value_dim {values.shape[3]}")
    if not isinstance(scale, (int, float, np.floating)):
        raise TypeError(f"scale must be a positive finite float; got {type(scale).__name__}")
    with np.errstate(over="ignore"):
        as_float32 = np.float32(scale)  # what the kernel reads
    if not (np.isfinite(as_float32) and as_float32 > 0):
        raise ValueError(f"scale must be a positive finite float (in float32, as the kernel reads it); got {scale!r}")
    return intervals, _check_sinks(sink_logits, Hq)


def _check_intervals(intervals, Tq: int) -> mx.array:
    """``intervals`` as an int32 MLX array ``[T_q, P, 2]`` (a numpy integer array is converted).

    :raises TypeError, ValueError: as :func:`check_inputs`."""
    if isinstance(intervals, np.ndarray):
        if intervals.dtype.kind not in "iu":
            raise TypeError(f"intervals must be int32; got numpy {intervals.dtype}")
        intervals = mx.array(np.clip(intervals, -2**31, 2**31 - 1).astype(np.int32))
    if not isinstance(intervals, mx.array):
        raise TypeError(f"intervals must be an int32 mlx array [T_q, P, 2]; got {type(intervals).__name__}")
    if intervals.dtype != mx.int32:
        raise TypeError(f"intervals must be int32; got {intervals.dtype}")
    if intervals.ndim != 3 or intervals.shape[0] != Tq or intervals.shape[2] != 2:
        raise ValueError(f"intervals must be [T_q={Tq}, P, 2]; got shape {tuple(intervals.shape)}")
    if not 1 <= intervals.shape[1] <= MAX_INTERVALS:
        raise ValueError(f"intervals must hold 1 to {MAX_INTERVALS} intervals per row (P); got {intervals.shape[1]}")
    return intervals


def _check_sinks(sink_logits, Hq: int) -> mx.array | None:
    """``sink_logits`` as float32 ``[H_q]``, or ``None``. :raises TypeError, ValueError: as :func:`check_inputs`."""
    if sink_logits is None:
        return None
    if not isinstance(sink_logits, mx.array) or not mx.issubdtype(sink_logits.dtype, mx.floating):
        raise TypeError(f"sink_logits must be a floating-point mlx array [H_q] or None; got "
                        f"{getattr(sink_logits, 'dtype', type(sink_logits).__name__)}")
    if tuple(sink_logits.shape) != (Hq,):
        raise ValueError(f"sink_logits must be [H_q={Hq}]; got shape {tuple(sink_logits.shape)}")
    return sink_logits.astype(mx.float32)


def prefill_attend(queries: mx.array, keys: mx.array, values: mx.array, intervals, scale: float,
                   sink_logits: mx.array | None = None, return_lse: bool = False):
    """Attention of ``queries`` over ``keys``/``values`` where query row ``r`` sees column ``c`` iff
    ``intervals[r, p, 0] <= c < intervals[r, p, 1]`` for some ``p`` (the same for every batch row and head), in one
    launch of the tensor-core kernel (module docstring; FlashAttention-2, Dao 2023).

    :param queries: ``[B, H_q, T_q, D]`` float16 or bfloat16.
    :param keys: ``[B, H_kv, N, D]``, the queries' dtype; query head ``h`` reads KV head ``h // (H_q // H_kv)``.
    :param values: ``[B, H_kv, N, D_v]``, the queries' dtype; ``D_v == D`` (:func:`supported`).
    :param intervals: int32 ``[T_q, P, 2]``, ``1 <= P <= MAX_INTERVALS`` (an integer numpy array is converted):
        ``[lo, hi)`` column ranges of the keys as given; an empty one (``lo >= hi``) shows nothing, and columns
        outside ``[0, N)`` are ignored. Intervals may overlap (a column is seen once).
    :param scale: the softmax scale applied to ``q . k`` (positive, finite).
    :param sink_logits: ``[H_q]`` learned sink logits (gpt-oss; MLX's ``sinks=``): one unscaled logit per head that
        joins the softmax normaliser and has no value; ``None`` for none.
    :param return_lse: also return the log-sum-exp.
    :return: ``out [B, H_q, T_q, D]`` in the queries' dtype; with ``return_lse`` ``(out, lse)``, ``lse`` float32
        ``[B, H_q, T_q]``: the natural log of the normaliser ``out`` was divided by, i.e. of ``sum exp(scale q.k)``
        over the visible columns plus ``exp(sink logit)`` where given, so ``(out, lse)`` merges with other parts by
        log-sum-exp (:func:`kvq.attention.merge_parts`). A row that sees no column gets ``out`` 0 and ``lse`` -inf
        (the sink logit with ``sink_logits``).
    :raises TypeError, ValueError: bad arguments (:func:`check_inputs`; each message names the argument).
    :raises RuntimeError: MLX's default device is not a CUDA GPU (the kernel is CUDA only).
    """
    intervals, sinks = check_inputs(queries, keys, values, intervals, scale, sink_logits)
    if gpu_backend() != "cuda":
        raise RuntimeError(f"prefill_attend runs on MLX's CUDA back end only; the default device is "
                           f"{mx.default_device()} ({gpu_backend() or 'no GPU back end'})")
    return launch(queries, keys, values, intervals, scale, sinks, return_lse)


def launch(queries: mx.array, keys: mx.array, values: mx.array, intervals: mx.array, scale: float,
           sinks: mx.array | None, return_lse: bool = False):
    """:func:`prefill_attend` on arguments :func:`check_inputs` has already returned (``intervals`` int32,
    ``sinks`` float32 or ``None``), on a CUDA device: the launch alone."""
    plan = launch_plan(tuple(queries.shape), tuple(keys.shape), queries.dtype, intervals.shape[1], scale,
                       sinks is not None, TUNING.minb.get(queries.shape[-1], 0), launch_warpgroups(queries.shape[-1]),
                       TUNING.pipeline)
    inputs = [queries, keys, values, intervals, intervals if sinks is None else sinks]
    # the template baked into the kernel's text (kvq_metal.dialect.KernelObject.bound): MINB takes effect there
    call, template, kept = PREFILL_ATTEND_TC.kernel("cuda", INPUTS, OUTPUTS).bound(plan.template, inputs,
                                                                                  shared_memory=plan.dynamic_bytes)
    out, lse = call(inputs=[inputs[i] for i in kept], template=template, grid=plan.grid,
                    threadgroup=plan.threadgroup, output_shapes=list(plan.output_shapes),
                    output_dtypes=list(plan.output_dtypes))
    return (out, lse) if return_lse else out


@functools.cache
def _wgmma_device() -> bool:
    """:func:`has_wgmma`, asked once per process (the hot path's)."""
    return has_wgmma()


def launch_warpgroups(head_dim: int) -> int:
    """The warpgroups a block of :func:`launch` has at ``head_dim`` on this device with :data:`TUNING`: the knob's
    ``warpgroups`` where the device runs ``wgmma`` and :func:`wgmma_serves` ``head_dim``, else 0 (``mma.sync``)."""
    return TUNING.warpgroups if _wgmma_device() and wgmma_serves(head_dim) else 0


def check_intervals(num_intervals: int, rows: int) -> np.ndarray:
    """The intervals of :func:`check_parity`'s chunk, int32 ``[rows, num_intervals, 2]`` over 260 columns, disjoint
    as a cache's parts are: row ``r`` sees its causal band ``[160, 161 + r)``, then compressed columns ``[4, 4 +
    min(96, 20 + r))``, the sinks ``[0, 4)`` and a second window piece ``[100, 100 + min(60, r // 2 + 1))`` (a
    rotating cache's), the first ``num_intervals`` of these."""
    r = np.arange(rows)
    spans = [(160 + 0 * r, 161 + r), (4 + 0 * r, 4 + np.minimum(96, 20 + r)), (0 * r, 4 + 0 * r),
             (100 + 0 * r, 100 + np.minimum(60, r // 2 + 1))][:num_intervals]
    return np.stack([np.stack(span, axis=-1) for span in spans], axis=1).astype(np.int32)


def check_parity(head_dim: int, dtype: mx.Dtype, num_intervals: int, sinks: bool, n_rep: int) -> tuple[bool, str]:
    """The first-use check of one kernel variant (:func:`kvq_metal.base.first_use_check`): two batch rows of a chunk
    of 83 query rows (so ``n_rep * 83`` block rows: a last block only partly filled) of ``2 * n_rep`` query heads
    over 2 KV heads and 260 columns with :func:`check_intervals`, against :func:`reference_attend`: output within 2e-2
    of the reference's largest value (16-bit probabilities: FlashAttention's rounding) and log-sum-exp within 1e-2
    where a row sees anything. :return: ``(passed, detail)``."""
    Tq, n = 83, 260
    kq, kk, kv, ks = mx.random.split(mx.random.key(51), 4)
    q = mx.random.normal((2, 2 * n_rep, Tq, head_dim), key=kq).astype(dtype)
    k = mx.random.normal((2, 2, n, head_dim), key=kk).astype(dtype)
    v = mx.random.normal((2, 2, n, head_dim), key=kv).astype(dtype)
    sink = mx.random.normal((2 * n_rep,), key=ks) if sinks else None
    intervals, scale = check_intervals(num_intervals, Tq), head_dim ** -0.5
    out, lse = prefill_attend(q, k, v, intervals, scale, sink, return_lse=True)
    want, want_lse = reference_attend(q, k, v, intervals, scale, sink)
    err = (mx.abs(out.astype(mx.float32) - want).max() / mx.maximum(mx.abs(want).max(), 1e-6)).item()
    seen = mx.isfinite(want_lse)
    lse_err = mx.where(seen, mx.abs(lse - want_lse), 0.0).max().item()
    same_empty = mx.array_equal(seen, mx.isfinite(lse)).item()
    ok = err < 2e-2 and lse_err < 1e-2 and same_empty
    return ok, f"relative error {err:.2e}, lse error {lse_err:.2e} vs float32 reference (empty rows alike: {same_empty})"


def visibility(intervals: mx.array, num_columns: int) -> mx.array:
    """bool ``[T_q, num_columns]``: whether row ``r`` sees column ``c`` (``intervals[r, p, 0] <= c <
    intervals[r, p, 1]`` for some ``p``; :func:`kvq.cache.parts.visible` for several intervals)."""
    columns = mx.arange(num_columns)[None, None]
    lo, hi = intervals[..., 0:1], intervals[..., 1:2]
    return ((columns >= lo) & (columns < hi)).any(axis=1)


def reference_attend(queries: mx.array, keys: mx.array, values: mx.array, intervals, scale: float,
                     sink_logits: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Pure-MLX reference of :func:`prefill_attend` (same arguments), in float32: the masked scores of every head
    materialised (``B * H_q * T_q * N`` floats: for tests).

    :return: ``(out [B, H_q, T_q, D_v], lse [B, H_q, T_q])`` float32, as :func:`prefill_attend` with
        ``return_lse`` (rows that see nothing: out 0, lse -inf or the sink logit).
    """
    intervals = mx.array(intervals) if isinstance(intervals, np.ndarray) else intervals
    B, Hq, Tq, _ = queries.shape
    rep = Hq // keys.shape[1]
    k = mx.repeat(keys.astype(mx.float32), rep, axis=1)
    v = mx.repeat(values.astype(mx.float32), rep, axis=1)
    scores = (queries.astype(mx.float32) * scale) @ k.swapaxes(-1, -2)
    scores = mx.where(visibility(intervals, keys.shape[2]), scores, -mx.inf)
    if sink_logits is not None:
        sink = mx.broadcast_to(sink_logits.astype(mx.float32)[None, :, None, None], (B, Hq, Tq, 1))
        scores = mx.concatenate([sink, scores], axis=-1)
    lse = mx.logsumexp(scores, axis=-1)
    weights = mx.exp(scores - mx.where(lse == -mx.inf, 0.0, lse)[..., None])
    if sink_logits is not None:
        weights = weights[..., 1:]
    return weights @ v, lse
