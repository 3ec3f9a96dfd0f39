"""The launch knobs of the two decode-attention families and the prefill kernel, as frozen defaults.

The library launches with these values only: nothing in it reads an environment variable or changes them. A
benchmark that sweeps them swaps a family's whole object for an edited copy for the duration of its run
(``benchmarks/knobs.py``: ``with tuned(attend={"nt": 1}): ...``; tests use pytest's ``monkeypatch.setattr``). Every
plan cache keys on the object, so a swapped one takes effect on the next call. Every combination gives the same
results up to float32 rounding (the knobs move work between threads, registers and shared memory, never skip any).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class AttendKnobs:
    """Knobs of :mod:`kvq_metal.attend` (codes that decode as ``table[code] * scale + bias``).

    SIMT kernel (Metal, and CUDA shapes the tensor-core kernel does not take): ``kt_small`` / ``kt_large`` tokens
    each thread loads per tile for up to 4 query rows and for more; ``cpt`` 4 forces 4 coordinates per thread
    (``None``: 8 for 1-4 bits, 4 above).

    Tensor-core kernel (CUDA, :mod:`kvq_metal.attend_tc`): ``tc`` whether it serves the shapes it takes; ``nt``
    16-token tiles per warp step; ``pf`` loads of the next step issued before this step's math (``None``: at
    head_dim <= 128; off: it costs registers and measured no faster on the H200); ``pair`` pair tables (two codes
    per lookup); ``tc_groups`` thread groups to aim for (fewer, longer splits keep a block's warps busy longer);
    ``rep`` one copy of each code table per lane where shared memory allows (lookups without bank conflicts;
    :func:`kvq_metal.attend.table_layout`); ``qsh`` the query fragments read from shared memory instead of held in
    registers (16 to 32 registers fewer per thread; on: 4-9% less GPU time per call at 4K-128K on the H200,
    benchmarks/results/kernels/2026-12-02-h200-durations-qsh.json); ``minb`` (bound decode steps) the blocks per SM
    the compiler must fit (``__launch_bounds__(THREADS, minb)``; 0: no bound). As MLX built it on the H200 on
    2026-12-03 the bound step at head_dim 128 took 186 registers for turboquant-4, 130 for turboquant-3 and 198 for
    affine-4 (146, 130 and 140 on the H100 on 2026-12-06, Nsight Compute);
    ``minb`` 3 makes each 168 and at one sequence of 128K changed the GPU time by -1%, -2% and +3%: there the grid,
    not registers, bounds the occupancy, so it stays off until a batched run shows it pays
    (benchmarks/results/kernels/2026-12-03-h200-durations-minb-7f67dd3.json). ``minb_wide`` the same for a bound
    step whose rows alone fill ``tc_groups`` (a large batch: ``B * H_kv >= tc_groups``), whose sides both
    decode through tables, at head_dim <= 128 (0: ``minb``; :func:`kvq_metal.attend_tc.minb`): there the registers bound the blocks per SM, and at 122 sequences of 32K on
    an H100 ``minb_wide`` 4 took the bound turboquant-4 and -3 steps from 1,735 and 1,733 to 1,602 and 1,599 us
    (``kvq bench capacity``: turboquant-3 1,548 -> 1,629 tokens/s), while affine-4's table-free step was unchanged
    (1,758 / 1,763 us) and its capacity run slower (1,320 -> 1,241 tokens/s, one batch size apart)
    (benchmarks/results/kernels/2026-12-06-h100-durations-batch122-minb-7e9c8f6.json,
    benchmarks/results/capacity/2026-12-06-h100-capacity*-7e9c8f6.json). ``lin`` 4-bit integer levels with
    group scales and biases (``affine``) decoded arithmetically instead of from a table
    (:func:`kvq_metal.attend_tc.linear`). ``flat32``: on the path whose offsets fit 32 bits, each load's offset is
    taken from its array's start (the block's (batch, KV head) row base folded into the lane's loop-invariant part)
    instead of from the row: two instructions fewer per load address, more registers (nvcc sm_90, the bound step at
    head_dim 128: the main loop per 32 tokens turboquant-4 780 -> 723 instructions, turboquant-3 823 -> 766,
    affine-4 1,031 -> 953; registers 148 -> 223, 139 -> 167, 144 -> 202); where both sides decode through tables
    only (:func:`kvq_metal.attend_tc.flat32` says why not for affine's table-free decode). ``slack``: the online
    softmax's running max moves (and the accumulators are rescaled) only where a row's scores exceed it by more
    than this many log2 units (0 to 8; 0: at every step; :func:`kvq_metal.attend_tc.slack`). Probabilities then
    reach 2^slack, and where a side's per-vector scale (a value norm) is folded into them before their float16
    conversion, a norm above 65,504 / 2^slack would overflow (4,094 at 4; at 0, 65,504 as before). So 0 by
    default: nothing bounds a model's value norms below 4,094, and an overflow would be a silent wrong answer. At 4
    it measured little (one H100, 2026-12-07, ``benchmarks/results/kernels/2026-12-07-h100-durations-*``): at 122
    sequences of 32K the bound turboquant-4 and -3 steps took 1,519 and 1,311 us against 1,583 and 1,330 at 0, and at
    one sequence of 128K turboquant-3's took 86.0 us against 78.1 (turboquant-4 83.2 / 82.8, affine-4 93.3 / 93.4).
    """

    kt_small: int = 8
    kt_large: int = 8
    cpt: int | None = None
    tc: bool = True
    nt: int = 2
    pf: bool | None = False
    pair: bool = True
    tc_groups: int = 264
    rep: bool = True
    qsh: bool = True
    minb: int = 0
    minb_wide: int = 4
    lin: bool = True
    flat32: bool = True
    slack: int = 0


@attrs.frozen
class StreamsKnobs:
    """Knobs of :mod:`kvq_metal.streams` (code streams: QJL, TurboQuant-Prod, VecInfer).

    ``kt`` tokens each thread loads per tile (loads in flight); ``groups`` thread groups to aim for across the
    splits (``None``: the back end's :data:`kvq_metal.attend.TARGET_GROUPS`); ``registers`` the registers a thread
    may give to query coordinates and accumulators (R rows times coordinates per thread): the launch takes more
    threads per token above it, and twice it at 32 threads per token (8 query rows). Tensor-core kernel (CUDA,
    where :func:`kvq_metal.streams_plan.tc_plan` serves the call): ``tc`` whether it serves, ``nt`` tiles of 16
    tokens per warp step, ``pf`` the next step's loads before this step's math (``None``: where one key and one
    value stream leave the registers for it), ``qsh`` query fragments from shared memory, ``rep`` ``False`` for
    single code tables (``None``: per-lane copies while shared memory allows), ``minb`` the blocks per SM its
    registers must allow (0: none; at head_dim up to :data:`kvq_metal.streams_plan.MINB_HEAD_DIM` only). On the
    H200 the defaults of ``nt``, ``pf``, ``qsh`` and ``rep`` take 0.84x, 1.02x and 0.80x the GPU time of the
    former default (two tiles, prefetch where it fits) at 32K for qjl+affine:4, turboquant_prod:4 and :3, and
    1.02x, 1.02x, 0.88x at 128K (benchmarks/results/streams/2026-12-02-h200-streams-tc-variants-kernel-times.json).
    ``minb`` 3 (168 registers; nvcc 13 spills 8 bytes for qjl+affine:4 with the sinks and window, 32-84 for
    turboquant_prod) took on one H100 (2026-12-07, ``benchmarks/streams_kernel_times.py``: the wall time of 40
    calls evaluated together, per call; one sequence, head_dim 128, 4 query rows, the sinks and window in the
    launch) 0.80x, 0.88x, 0.97x the time of no bound at 32K for those three methods and 0.87x, 0.85x, 0.98x at
    128K, with the same outputs (``benchmarks/results/streams/2026-12-07-h100-streams-merge-minb-9a24ff5.json``;
    measured beside a merge since reverted, which changed nothing in the call). Other batches and row counts
    are not measured.
    ``slack`` as :class:`AttendKnobs`' (the online softmax's running max moves past this many log2 units only; 0 by
    default for the same reason: the values' per-vector scales are folded into the probabilities here too).
    """

    kt: int = 4
    groups: int | None = None
    registers: int = 96
    tc: bool = True
    nt: int = 1
    pf: bool | None = False
    qsh: bool = True
    rep: bool | None = None
    minb: int = 3
    slack: int = 0


@attrs.frozen
class PrefillKnobs:
    """Knobs of :mod:`kvq_metal.prefill` (a prefill chunk's attention over 16-bit columns, issue #51).

    ``tc``: whether the tensor-core prefill kernel serves the chunks it takes (:meth:`kvq_metal.KernelImpl.
    attend_columns`; kvq's cache then attends a chunk without a mask array). Off: on one H200 (2026-12-06) its
    parity tests pass (``tests/test_prefill_kernel_gpu.py``, 23 of 23), but it is slower than the masked path it
    would replace: one layer's chunk of 2,048 over 8K held tokens in 2.34 ms against 1.45 ms for MLX's attention
    with the additive mask (0.67 ms causal, fp16's call), 7.14 against 3.84 ms at 32K (``benchmarks/
    prefill_masks.py``; :mod:`kvq_metal.prefill` says why). Either setting gives the same result within the
    tolerance of 16-bit attention (the kernel's first-use check compares it with the float32 reference); only the
    speed differs.

    ``minb``: head_dim -> the blocks per SM the compiler must fit the kernel's registers to
    (``__launch_bounds__(THREADS, minb)``; keys may be strings, as JSON gives them: ``benchmarks/knobs.py --prefill
    '{"minb": {"128": 3}}'``); a head_dim not in it gets no bound. At head_dim 128 nvcc 13 gives the
    kernel 170 registers (MLX's NVRTC build 173, by Nsight Compute), just above what 3 blocks of 128 threads allow
    (168), so ``{128: 3}`` would raise the occupancy from 8 to 12 warps per SM, with 16-24 bytes of spills (nvcc);
    not yet measured. At 256 (211-216 registers) a bound of 3 spills heavily; at 64 (about 130) it changes nothing.
    Registers only: the results are the same.

    ``warpgroups``: on compute capability 9.x (H100, H200: ``wgmma`` needs sm_90a, which MLX's JIT targets there),
    the kernel's products run on the warpgroup tensor-core instructions (``wgmma.mma_async``, B read from shared
    memory by the tensor cores) with this many warpgroups of 64 rows per block, sharing each K/V tile; 0 keeps
    ``mma.sync`` (as on every other GPU, and at head_dim 256 everywhere). The same arithmetic in float32
    accumulators, in another order: results agree within the float32 reference's tolerance, not bit for bit.
    On one H100 (2026-12-06, ``benchmarks/results/prefill/2026-12-06-h100-wgmma``) one warpgroup took a chunk of
    2,048 over 8K / 32K held tokens in 1.46-1.54 / 4.33 ms against 1.96-2.13 / 6.01-6.27 for ``mma.sync`` (two
    warpgroups: 1.40-1.81 / 4.61), and MLX's masked attention 1.41-1.67 / 3.73-4.05 in the same runs.

    ``pipeline``: the ``wgmma`` form with FlashAttention-3's intra-warpgroup overlap (template ``PIPE``): K and V
    tiles double-buffered in dynamic shared memory (66 KB a block at head_dim 128) and each tile's scores' product
    issued with the previous tile's values' product, so the softmax of one runs while the tensor cores do the
    other. Off where ``warpgroups`` is 0. On one H100 (2026-12-06, ``benchmarks/results/prefill/
    2026-12-06-h100-pipelined``) its parity tests pass and it buys nothing measurable: 1.61 / 4.50 ms for the chunk
    above at 8K / 32K against 1.52 / 4.64 without it (two warpgroups: 1.70 / 4.55), so it stays off.
    """

    tc: bool = False
    minb: dict = attrs.field(factory=dict, converter=lambda d: {int(k): int(v) for k, v in dict(d).items()})
    warpgroups: int = attrs.field(default=1, converter=int, validator=attrs.validators.in_((0, 1, 2)))
    pipeline: bool = attrs.field(default=False, converter=bool)
