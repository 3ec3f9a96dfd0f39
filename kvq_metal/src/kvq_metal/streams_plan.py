"""Launch planning of the streams kernel (:mod:`kvq_metal.streams`): from a call's static signature
(:func:`kvq_metal.streams._signature`: query rows and width, each stream's widths and flags, the outliers' sizes, the
uncompressed tokens, ``kt`` and the register budget) to the template of the SIMT kernel (:func:`plan`) or of the
tensor-core kernel on CUDA (:func:`tc_plan`), or the reason it does not serve the call. Pure functions of their
arguments, cached: the knobs they follow are arguments (:class:`kvq_metal.knobs.StreamsKnobs`).
"""

from __future__ import annotations

from functools import lru_cache

import attrs

from . import attend_tc
from .attend import MAX_ROWS, THREADS
from .knobs import StreamsKnobs

#: Most float32 entries of one stream's code table held in shared memory (VecInfer: 2**code_bits * sub_dim).
MAX_TABLE = 2048
#: Static shared memory a thread group may use (bytes; CUDA's static limit is 48 KB).
SHARED_BYTES = 46 * 1024
#: Most outlier channels and outlier sketch bits (QJL).
MAX_OUTLIER_CHANNELS, MAX_OUTLIER_BITS = 16, 256


@lru_cache(maxsize=1024)
def plan(signature: tuple) -> tuple[list | None, str]:
    """``(template, "")`` of the launch for a static signature, or ``(None, why)``: the threads per token (the
    fewest that give every stream whole codes, at most 32 bits of codes per thread and per stream, and queries
    and accumulators within the signature's register budget), the shared memory, the tables."""
    rows, dq, keys, values, outliers, (nd, sinks, head_dim, qscale), kt, registers = signature
    if not 1 <= rows <= MAX_ROWS:
        return None, f"{rows} query rows per KV head (the kernel takes 1..{MAX_ROWS})"
    if not 1 <= len(keys) <= 2 or not 1 <= len(values) <= 2:
        return None, "one or two key streams and one or two value streams"
    extra = (keys[1:], values[1:])
    for k in extra[0] + extra[1]:
        if k[2] != 1 or k[5] or k[6] or k[9] or k[8] != k[0]:
            return None, "a second stream must be scalar codes with one shared table and per-token scales"
    for s in keys + values:
        dim, bits, vec, scaled, cb, _, _, _, group, _ = s
        if not 1 <= bits <= 12 or (1 << bits) * vec > MAX_TABLE or scaled > 2:
            return None, f"a stream of {bits}-bit codes of {vec} coordinates (tables of at most {MAX_TABLE} entries)"
    if outliers is not None and not (1 <= outliers[0] <= MAX_OUTLIER_CHANNELS and outliers[1] <= MAX_OUTLIER_BITS):
        return None, f"{outliers[0]} outlier channels of {outliers[1]} sketch bits"
    out_dim = sum(v[0] for v in values)
    if out_dim % 32 or out_dim > 1024:
        return None, f"{out_dim} output coordinates (a multiple of 32, at most 1024: the merge's thread group)"
    # the fewest threads per token within the register budget, else (many query rows) within twice it
    for ncg, budget in [(n, registers) for n in (4, 8, 16, 32)] + [(32, 2 * registers)]:
        why = fits(ncg, rows, keys, values, budget)
        if not why:
            break
    else:
        return None, why
    if nd and (values[0][0] != head_dim or values[0][2] != 1 or head_dim % ncg):
        return None, (f"uncompressed tokens of head_dim {head_dim} with a first value stream of {values[0][0]} "
                      "coordinates (they must match)")
    shared = 4 * (rows * dq + kt * THREADS // ncg * rows + 8 * rows + rows * out_dim + rows * head_dim
                  + sum((1 << s[1]) * s[2] for s in keys + values) + (0 if outliers is None else
                                                                        outliers[0] * outliers[1]))
    if shared > SHARED_BYTES:
        return None, f"{shared} bytes of shared memory (at most {SHARED_BYTES})"
    ka, va = keys[0], values[0]
    kb = keys[1] if len(keys) > 1 else None
    vb = values[1] if len(values) > 1 else None
    ok, om, o_off = outliers or (0, 0, 0)
    t = [("DQ", dq), ("R", rows), ("NCG", ncg), ("KT", kt), ("THREADS", THREADS),
         ("KA_OFF", ka[7]), ("KA_DIM", ka[0]), ("KA_BITS", ka[1]), ("KA_VEC", ka[2]), ("KA_NS", ka[3]),
         ("KA_CB", ka[4]), ("KA_TH", ka[5]), ("KA_RES", ka[6]),
         ("KB_ON", kb is not None), ("KB_OFF", kb[7] if kb else 0), ("KB_DIM", kb[0] if kb else ncg),
         ("KB_BITS", kb[1] if kb else 1), ("KB_NS", kb[3] if kb else 0), ("KB_CB", kb[4] if kb else 4),
         ("OK", ok), ("OM", om), ("O_OFF", o_off),
         ("VA_DIM", va[0]), ("VA_BITS", va[1]), ("VA_VEC", va[2]), ("VA_G", va[8]), ("VA_NS", va[3]),
         ("VA_BIAS", va[9]), ("VA_CB", va[4]), ("VA_TH", va[5]), ("VA_RES", va[6]),
         ("VB_ON", vb is not None), ("VB_DIM", vb[0] if vb else ncg), ("VB_BITS", vb[1] if vb else 1),
         ("VB_NS", vb[3] if vb else 0), ("VB_CB", vb[4] if vb else 4), ("DO", out_dim),
         ("ND", nd), ("SINKS", bool(sinks)), ("D", max(head_dim, 1)), ("QSCALE", qscale)]
    return t, ""


#: 32-bit words of static shared memory the tensor-core kernel may declare (48 KB less a margin).
TC_SHARED_WORDS = 12288 - 256


#: Widest head_dim the knob ``minb`` (:class:`kvq_metal.knobs.StreamsKnobs`) bounds the tensor-core kernel at: the
#: bound was measured at 128 (``benchmarks/results/streams/README.md``, 2026-12-07).
MINB_HEAD_DIM = 128


@lru_cache(maxsize=1024)
def tc_plan(signature: tuple, ddt: int, nt: int, pf: bool | None = None, qsh: bool = False,
             rep: bool | None = None, minb: int = 0,
             slack: int = attrs.fields(StreamsKnobs).slack.default) -> tuple[list | None, str]:
    """``(template, "")`` of the tensor-core launch (``decode_attend_streams_tc.cu``) for a static signature
    (:func:`kvq_metal.streams._signature`), ``ddt`` the uncompressed tokens' dtype code (0 float16, 1 bfloat16, 2
    other), ``nt`` tiles of 16 tokens per warp step and the knobs ``pf``, ``qsh``, ``rep`` and ``minb`` of
    :class:`kvq_metal.knobs.StreamsKnobs` (arguments, so the cached plan follows them); ``(None, why)`` where it
    does not serve the call (the SIMT kernel then does).

    It takes: at most 8 query rows (one mma N tile); scalar codes of 1..8 bits per stream read from one shared
    table (no per-head tables, no reserved pattern: VecInfer stays on the SIMT kernel); every stream's
    coordinates a multiple of 16 up to 256; per-token key scales; value stream A with per-token scales or
    grouped scales and biases (groups whole slices of ``dim / 8`` coordinates or even divisors of one), stream B
    with per-token scales; uint8 codes whose rows are whole 32-bit words; at most 16 outlier channels of at most
    1024 sketch entries; uncompressed tokens of head_dim = value stream A's coordinates. Tables are pair tables
    (one lookup per two coordinates) up to 4 bits, each with one copy per lane while static shared memory
    allows (the largest loses its copies first; none with ``rep`` False); 1-bit streams decode four coordinates
    per lookup of a nibble table. ``pf``: the next step's loads issued before this step's math (``None``: where
    one key and one value stream leave the registers for it). ``qsh``: the query fragments are read from shared memory
    (one 64-bit load per k-step) instead of held in registers: about 32 registers fewer per thread, which bound the
    kernel's occupancy (compiled with nvcc, not yet run on a GPU: off by default). ``minb`` > 0: the kernel is
    built with ``__launch_bounds__(THREADS, minb)`` (:func:`kvq_metal.dialect.launch_bounds`), so the compiler keeps
    its registers within what ``minb`` blocks per SM allow (registers only: the same arithmetic), at head_dim up to
    :data:`MINB_HEAD_DIM` (the bound measured; wider heads would spill more) and unbounded above it. ``slack``: the
    online softmax's running max moves past that many log2 units only (:func:`kvq_metal.attend_tc.slack`, which
    raises ``ValueError`` for a value outside 0..8; the default is :class:`kvq_metal.knobs.StreamsKnobs`')."""
    rows, dq, keys, values, outliers, (nd, sinks, head_dim, qscale), _, _ = signature
    if not 1 <= rows <= 8:
        return None, f"{rows} query rows (the tensor-core kernel takes 1..8)"
    for side, streams in (("key", keys), ("value", values)):
        for i, (dim, bits, vec, scaled, cb, per_head, reserved, _, group, biases) in enumerate(streams):
            if vec != 1 or per_head or reserved:
                return None, f"{side} stream {i}: vector codes, per-head tables or a reserved pattern"
            if not (1 <= bits <= 8 and dim % 16 == 0 and 16 <= dim <= 256):
                return None, f"{side} stream {i}: {dim} coordinates of {bits}-bit codes"
            if cb == 1 and (dim * bits) % 32:
                return None, f"{side} stream {i}: uint8 rows of {dim * bits} bits (whole 32-bit words only)"
            grouped = group < dim or biases
            if (side == "key" or i > 0) and grouped:
                return None, f"{side} stream {i}: grouped scales or biases"
            if grouped:
                per = dim // 8
                if scaled != 1 or dim % group or not (group % per == 0 or (per % group == 0 and group % 2 == 0)):
                    return None, f"value stream 0: groups of {group} over slices of {per} coordinates"
    ok, om, o_off = outliers or (0, 0, 0)
    if ok and (ok > 16 or om * ok > 1024 or om % 8):
        return None, f"{ok} outlier channels of {om} sketch bits"
    if nd and (values[0][0] != head_dim or head_dim % 16 or not 16 <= head_dim <= 256):
        return None, f"uncompressed tokens of head_dim {head_dim} and {values[0][0]} value coordinates"
    ka, va = keys[0], values[0]
    kb = keys[1] if len(keys) > 1 else None
    vb = values[1] if len(values) > 1 else None
    out_dim = sum(v[0] for v in values)
    tables = [s[1] if s is not None else 0 for s in (ka, kb, va, vb)]
    pair = [0 < b <= 4 for b in tables]
    # words of one copy: 1-bit streams use nibble tables (16 entries of two half2 words)
    entries = [0 if b == 0 else 32 if b == 1 else (1 << (2 * b) if p else 1 << b) for b, p in zip(tables, pair)]
    copies = rep is not False  # the knob; the list below says which tables get per-lane copies
    rep = [0 < e <= 256 and copies for e in entries]
    warps = THREADS // 32
    qsh = bool(qsh)
    k_steps = max(ka[0] // 16 + (kb[0] // 16 if kb else 0), max(head_dim, 16) // 16)
    fixed = (rows * max(dq, head_dim) + om * ok + warps * nt * 16 * rows + 2 * warps * 8 + 64
             + (64 * k_steps if qsh else 2))

    def words() -> int:
        tab = sum(e * (32 if r else 1) for e, r in zip(entries, rep))
        return fixed + max(tab, rows * out_dim)

    while words() > TC_SHARED_WORDS and any(rep):
        rep[max((i for i in range(4) if rep[i]), key=lambda i: entries[i])] = False
    if words() > TC_SHARED_WORDS:
        return None, f"{4 * words()} bytes of shared memory (at most {4 * TC_SHARED_WORDS})"
    va_grouped = va[8] < va[0] or va[9]
    # the next step's loads issued before this step's math where registers allow: one key and one value stream
    pf = (kb is None and vb is None) if pf is None else bool(pf)
    minb = int(minb) if head_dim <= MINB_HEAD_DIM else 0
    t = [("R", rows), ("DQ", dq), ("THREADS", THREADS), ("NT", nt), ("PF", pf), ("QSH", qsh), ("MINB", minb),
         ("SLACK", attend_tc.slack(slack)),
         ("D", max(head_dim, 16)),
         ("DDT", ddt),
         ("ND", nd), ("SINKS", bool(sinks)), ("QSCALE", qscale), ("DO", out_dim),
         ("KA_OFF", ka[7]), ("KA_DIM", ka[0]), ("KA_BITS", ka[1]), ("KA_NS", ka[3]), ("KA_CB", ka[4]),
         ("KA_PAIR", pair[0]), ("KA_REP", rep[0]),
         ("KB_ON", kb is not None), ("KB_OFF", kb[7] if kb else 0), ("KB_DIM", kb[0] if kb else 16),
         ("KB_BITS", kb[1] if kb else 1), ("KB_NS", kb[3] if kb else 0), ("KB_CB", kb[4] if kb else 4),
         ("KB_PAIR", pair[1]), ("KB_REP", rep[1]),
         ("OK", ok), ("OM", om), ("O_OFF", o_off),
         ("VA_DIM", va[0]), ("VA_BITS", va[1]), ("VA_NS", va[3]), ("VA_G", va[8]), ("VA_GRP", bool(va_grouped)),
         ("VA_BIAS", bool(va[9])), ("VA_CB", va[4]), ("VA_PAIR", pair[2]), ("VA_REP", rep[2]),
         ("VB_ON", vb is not None), ("VB_DIM", vb[0] if vb else 16), ("VB_BITS", vb[1] if vb else 1),
         ("VB_NS", vb[3] if vb else 0), ("VB_CB", vb[4] if vb else 4), ("VB_PAIR", pair[3]), ("VB_REP", rep[3])]
    return t, ""


def fits(ncg: int, rows: int, keys: tuple, values: tuple, budget: int) -> str:
    """Why ``ncg`` threads per token do not serve these streams (empty when they do)."""
    coords = 0
    for side, streams in (("key", keys), ("value", values)):
        for s in streams:
            dim, bits, vec, _, _, _, _, _, group, _ = s
            per = dim // ncg
            if dim % (ncg * vec) or per == 0:
                return f"{side} stream of {dim} coordinates in codes of {vec} does not split over {ncg} threads"
            if per // vec * bits > 32:
                return f"{side} stream: {per // vec * bits} bits of codes per thread (at most 32)"
            if side == "value" and group < dim and group % per:
                return f"value stream: groups of {group} do not hold whole runs of {per} coordinates"
            coords += per
    if rows * coords > budget:
        return f"{rows} rows of {coords} coordinates per thread exceed {budget} registers"
    return ""
