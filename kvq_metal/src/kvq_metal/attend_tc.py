"""Fused decode attention on tensor cores (CUDA, sm_80 and later): the same contract as :mod:`kvq_metal.attend`.

Why a second kernel: the SIMT kernel multiplies every decoded coordinate by every query row in fp32 and reduces a
token's partial scores with SIMD shuffles; at long context it is bound by instruction issue and latency, not by the
bytes it reads. Here each warp decodes a tile of 16 tokens straight into the register fragments of
``mma.sync.m16n8k16`` (fp16 in, fp32 accumulate) and runs both products on tensor cores, the layout of
FlashAttention-2 (Dao 2023) turned on its side for decode:

* scores: ``S^T [16 tokens, 8 rows] = K [16, D] · Q^T [D, 8]``: keys are the A operand, so the query rows (at most
  8: ``n_rep * T_q``) fill the N dimension and nothing is wasted for GQA groups of 4 to 8;
* values: ``O^T [D, 8] += V^T [D, 16] · P^T [16, 8]``: the probabilities' accumulator layout is transposed into the
  B operand with ``movmatrix`` (no shared memory).

A dot product does not care in which order its coordinates come, so each thread owns a contiguous slice of a
token's codes (``D / 4`` coordinates of 2 tokens for keys, ``D / 8`` of 4 tokens for values), reads it with a few
coalesced word loads and decodes two coordinates per shared-memory lookup: a pair table holds
``(table[a], table[b])`` as one half2 for every pair of codes (``2 * bits <= 8``; a single-code table otherwise).
Per-vector scales (norms) are applied in fp32 to the scores and folded into the probabilities; grouped
scales and biases are applied while decoding, with one ``fma.f16x2`` per pair. The online softmax runs
in registers (a row's maximum is reduced over the 8 lanes that hold it); the 4 warps of a block merge their
``(out, max, sum)`` in shared memory and write one split. The last block of a (batch, KV head) row to finish (an
atomic counter per row) merges the row's splits with log-sum-exp, adds the splits of uncompressed tokens, undoes
the Hadamard rotation and writes the output: no merge launch (flash-decoding's combine step, in the same kernel).

Memory: each lane has its own copy of a code table where static shared memory allows (no bank conflicts;
:func:`kvq_metal.attend.table_layout`). A lookup is three instructions: the code field shifted straight to its
entry's byte offset, the lane's copy OR'd in, and a shared-memory load that adds the table's base itself from a
uniform register (``kvq_table_base``: a shuffle from lane 0 tells the compiler the base is warp-uniform; without it
the base stayed in an ordinary register, one more add per lookup). Aligned rows of
codes are read with 128/64-bit loads; a block whose rows all allow that, with every offset inside a (batch, KV
head) row within 32 bits and no negative stride, runs a copy of the warp's loop compiled for exactly that case (one
multiply-add per load address, no word-by-word path predicated in beside the vector loads), others the general
loop. The blocks of the same launch that attend a cache's uncompressed sinks and
window (``ND = 2``: the kernel body is instantiated once per role, sharing the block's shared memory) read
float16/bfloat16 rows the same way. Measured with Nsight Compute on an H200:
``benchmarks/results/kernels/README.md``.

Precision: queries and decoded keys and values are fp16 (11-bit significand), products accumulate in fp32: the
numerics of fp16 FlashAttention. Parity with pure MLX is checked on first use like every kernel here.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from .kernel_files import KERNELS, load

#: The kernel and its header (kernel files in ``kvq_metal/kernels``); launcher: :func:`kvq_metal.attend.decode_attend`.
DECODE_ATTEND_TC = load(KERNELS / "decode_attend_tc.cu", header=KERNELS / "decode_attend_tc.cuh")


@lru_cache(maxsize=1024)
def supported(head_dim: int, key_bits: int, value_bits: int, key_group: int, value_group: int, rows: int,
              key_bits2: int = 0, value_bits2: int = 0) -> bool:
    """Whether the tensor-core kernel serves this shape: ``rows <= 8`` (one mma N tile), ``head_dim`` a multiple of
    16 from 32 to 256, codes of at most 8 bits per stream (tables of at most 256 entries), groups that are whole
    slices or whole multiples of pairs inside a slice (``D / 4`` key and ``D / 8`` value coordinates per thread)."""
    if not (1 <= rows <= 8 and head_dim % 16 == 0 and 32 <= head_dim <= 256):
        return False
    if not all(1 <= b <= 8 for b in (key_bits, value_bits)) or key_bits + key_bits2 > 8 or \
            value_bits + value_bits2 > 8:
        return False
    for group, slice_ in ((key_group, head_dim // 4), (value_group, head_dim // 8)):
        if head_dim % group:
            return False
        if not (group % slice_ == 0 or (slice_ % group == 0 and group % 2 == 0)):
            return False
    return True


#: 32-bit words of static shared memory a CUDA thread block may declare (48 KB).
SHARED_WORDS = 12288
#: The kernel's code for the dtype of uncompressed tokens (``DDT``): float16 and bfloat16 rows are read with vector
#: loads (bfloat16 converted to float16), any other dtype element by element.
DENSE_DTYPES = {mx.float16: 0, mx.bfloat16: 1}


def linear(levels: bool, bits: int, bits2: int, biased: bool, group: int, head_dim: int, slice_: int) -> bool:
    """Whether the kernel decodes a side without its table (template ``KLIN`` / ``VLIN``): 4-bit codes of one
    stream whose table is the integer levels 0..15 (``levels``, ``affine``), with group scales or biases (not one
    scale per vector, which the kernel applies outside the decode), slices (``slice_`` coordinates per thread:
    ``head_dim / 4`` keys, ``head_dim / 8`` values) of whole 32-bit words, and groups of whole words (a pair holds
    coordinates ``k`` and ``k + 4`` of a word, which must share a scale). A pair of codes is then one shift and one
    ``lop3`` into the half2 ``16 + code`` and one ``sub.f16x2`` to the codes themselves (after FasterTransformer's
    int4-to-half conversion; Kim et al. 2022, "Who Says Elephants Can't Run?"), and the group's fma takes them to
    ``code * scale + bias`` exactly as from the table: no table lookup (two address instructions and a
    shared-memory load per pair with a table). ``bits`` 1..8; ``levels`` is the caller's word (:class:`kvq_metal.
    attend.Side`), not checked against the table."""
    return (levels and bits == 4 and bits2 == 0 and (biased or group < head_dim) and slice_ % 8 == 0
            and group % 8 == 0)


@lru_cache(maxsize=1024)
def table_layout(head_dim: int, rows: int, kb: int, kb2: int, vb: int, vb2: int, same_table: bool, pair: bool,
                 rep: bool, qsh: bool = False, klin: bool = False, vlin: bool = False) -> tuple[bool, bool, bool]:
    """``(KREP, VREP, VSAME)`` (:func:`kvq_metal.attend.table_layout`) from the code widths (``bits``, ``bits2``
    per side), whether both sides hold the same table object, the knobs ``pair``, ``rep`` and ``qsh``
    (:class:`kvq_metal.knobs.AttendKnobs`), and ``klin`` / ``vlin`` (a side decoded without a table,
    :func:`linear`: it takes no copies and no shared table)."""
    same = same_table and (kb, kb2) == (vb, vb2) and not (klin or vlin)
    key_code_bits, value_code_bits = kb + kb2, vb + vb2
    def entries(cb: int) -> int:
        return 1 << (2 * cb) if pair and 2 * cb <= 8 else 1 << cb

    # left after the queries (and their fragments with qsh), the warps' (max, sum), the staged tables
    # and a margin
    free = (SHARED_WORDS - rows * head_dim - 2 * 4 * 8 - (1 << key_code_bits) - (1 << value_code_bits) - 64
            - (4 * head_dim if qsh else 0))
    ke, ve = 0 if klin else entries(key_code_bits), 0 if same or vlin else entries(value_code_bits)
    for krep, vrep in ((True, True), (True, False), (False, True), (False, False)):
        if not rep and (krep or vrep) or klin and krep or vlin and vrep:
            continue
        if same and krep != vrep:
            continue
        if ke * (32 if krep else 1) + ve * (32 if vrep else 1) <= free:
            return krep, vrep, same
    return False, False, same


def template(**flags) -> list:
    """The kernel's template arguments, in their fixed order: ``flags`` (``D``, ``R``, ``KG``, ``VG``, ``THREADS``,
    ``NT`` and ``DV`` always) over the defaults of a launch without bits, biases, copies or uncompressed tokens."""
    t = {"D": None, "R": None, "KB": 1, "VB": 1, "KG": None, "VG": None, "KBIAS": False, "VBIAS": False, "KB2": 0,
         "VB2": 0, "THREADS": None, "ROT": False, "QSCALE": None, "NT": None, "PF": False, "QSH": False,
         "PAIRTAB": True, "SINKS": False, "DDT": 0, "KREP": False, "VREP": False, "VSAME": False, "ND": 0, "DV": None,
         "MINB": 0, "RAGGED": False, "KLIN": False, "VLIN": False, "FLAT32": False, "SLACK": 0}
    t.update(flags)
    return list(t.items())


def minb(knobs, head_dim: int, lin: tuple[bool, bool], wide: bool) -> int:
    """The blocks per SM a bound decode step's registers must fit (template ``MINB``, 0: no bound): ``knobs.minb_wide``
    for a launch whose rows alone fill the split target (``wide``) with both sides decoded through tables (no
    ``lin`` side) at ``head_dim`` <= 128, where that knob is set; else ``knobs.minb``
    (:class:`kvq_metal.knobs.AttendKnobs`). At head_dim 256 four blocks' registers (128 per thread) spill 2.7 KB
    per thread inside the main loop (nvcc sm_90, ``benchmarks/investigations/nvcc_registers.py --turboquant
    --tuning '{"minb": 4}'``)."""
    if wide and not any(lin) and head_dim <= 128 and knobs.minb_wide:
        return int(knobs.minb_wide)
    return int(knobs.minb or 0)


def flat32(knobs, lin: tuple[bool, bool]) -> bool:
    """The template ``FLAT32`` (offsets from each array's start on the 32-bit path): ``knobs.flat32``
    (:class:`kvq_metal.knobs.AttendKnobs`) where both sides decode through tables (``lin`` ``(KLIN, VLIN)``,
    :func:`linear`). Not for affine's table-free decode: there its registers (nvcc: 144 -> 202 per thread) left a
    wide launch two blocks per SM instead of three, and 122 sequences of 32K took 1,990 us a bound step with it
    (and the loop's other cuts, slack 8) against 1,802 at ``02bb7c5`` (one H100,
    benchmarks/results/kernels/2026-12-06-h100-durations-loop-*-batch122.json; flat32 alone was not measured).
    A block whose row ends beyond 2^31 elements of an array from its start takes the general 64-bit path."""
    return bool(knobs.flat32) and not any(lin)


def slack(value) -> int:
    """The template ``SLACK`` of the tensor-core decode kernels from a knob (``AttendKnobs.slack``,
    ``StreamsKnobs.slack``): how far, in log2 units, a row's scores may exceed its running max before the online
    softmax moves it and rescales the accumulators (0: at every step, the textbook online softmax). The result is
    the same softmax, but probabilities reach 2^SLACK, and a per-vector value scale folded into them before their
    float16 conversion must stay below 65,504 / 2^SLACK (4,094 at 4; 255 at 8, FlashAttention-4's choice, whose
    values are not folded in): the default is 0 (:class:`kvq_metal.knobs.AttendKnobs` says why).

    :raises ValueError: ``value`` is not an integer from 0 to 8."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 8:
        raise ValueError(f"slack must be an integer from 0 to 8 (log2 units; 0: rescale at every step); got {value!r}")
    return value


def launch_template(common: tuple, nd: int, out_dim: int, layout: tuple, knobs, sinks: bool,
                    ddt: int, lin: tuple[bool, bool] = (False, False), wide: bool = False) -> tuple[list, int]:
    """The launch's template (:func:`template`) and its tile (compressed tokens per block step), for
    :func:`kvq_metal.attend._launch_plan` (which caches it): ``common`` the template arguments every
    decode-attention kernel takes (``THREADS`` among them), ``nd`` the blocks of uncompressed tokens (0, or 2:
    sinks and window, ``sinks`` whether there are any, ``ddt`` their :data:`DENSE_DTYPES` code), ``layout``
    :func:`table_layout`'s answer, ``knobs`` a :class:`kvq_metal.knobs.AttendKnobs`, ``lin`` ``(KLIN, VLIN)``
    (:func:`linear`), ``wide`` the launch's rows alone fill the split target (its launch bound is then
    ``knobs.minb_wide`` where both sides use tables and that knob is set, else ``knobs.minb``)."""
    D, threads = dict(common)["D"], dict(common)["THREADS"]
    krep, vrep, same = layout
    pf = D <= 128 if knobs.pf is None else knobs.pf
    args = template(**dict(common), NT=knobs.nt, PF=bool(pf), QSH=bool(knobs.qsh), PAIRTAB=bool(knobs.pair),
                    KREP=krep, VREP=vrep, VSAME=same, ND=nd, SINKS=sinks, DDT=ddt, DV=out_dim,
                    MINB=minb(knobs, D, lin, wide), KLIN=lin[0], VLIN=lin[1], FLAT32=flat32(knobs, lin),
                    SLACK=slack(knobs.slack))
    return args, 16 * knobs.nt * threads // 32
