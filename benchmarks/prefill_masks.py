"""What the additive mask of a prefill chunk costs in MLX's fused attention, and layouts of it that cost less (#23).

    python benchmarks/prefill_masks.py OUT_DIR [--contexts 8K,32K,128K] [--chunk 2048] [--method turboquant:3]
        [--reps 10] [--minb N] [--warpgroups N] [--pipeline]

One layer's kvq cache (random keys and values, sinks 4, window 128, flush 128) holds ``context`` tokens; a chunk
of ``--chunk`` tokens is stored and its attention inputs are built as :meth:`kvq.cache.KVQCache.attend` builds
them on a GPU (``[sinks | compressed decoded | window and chunk]`` keys, the additive mask of
:func:`kvq.cache.prefill.interval_mask`). Then the median seconds of ``mx.fast.scaled_dot_product_attention`` with:

- ``causal``: fp16's own prefill call (``mask="causal"`` over ``context + chunk`` keys), the speed to reach;
- ``none``: no mask over the kvq keys;
- ``full``: the ``[T_q, keys]`` additive mask (what the cache does today);
- ``row_broadcast``: a ``[1, keys]`` mask broadcast over the rows (no per-row pattern: only says whether the
  cost is the mask's bytes);
- ``blocks_view``: the chunk's rows cut into blocks of ``flush`` rows that see the same compressed tokens, the
  blocks as the batch axis (keys and values broadcast over it), and the mask a strided view of one small
  ``[flush, keys + blocks * flush]`` buffer (block ``k`` reads it shifted by ``k * flush`` columns);
- ``blocks_dense``: the same blocks with the mask written out ``[blocks, 1, flush, keys]``;
- ``kernel``: kvq_metal's prefill kernel (:func:`kvq_metal.prefill.prefill_attend`, CUDA), each row's visibility
  computed in the kernel from its column intervals (:func:`kvq.cache.prefill.column_intervals`): no mask array.

Every variant's output but ``causal``, ``none`` and ``row_broadcast`` is compared with ``full``'s (max absolute difference, in the JSON). Writes
OUT_DIR/prefill_masks.json.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
# this folder's (scripts run as benchmarks/NAME.py)
from prefill_parts import _size, layer_inputs, layer_parser, layer_source, timed, write_row


def chunk_inputs(cache, queries, k_new, v_new):
    """The keys, values and full additive mask that the cache's GPU prefill path builds for this chunk
    (:func:`kvq.cache.prefill.columns`, :func:`kvq.cache.prefill.interval_mask` over the chunk's parts,
    :meth:`kvq.cache.KVQCache.parts`), the per-row count of compressed tokens seen (``bounds``) and the rows'
    column intervals (:func:`kvq.cache.prefill.column_intervals`)."""
    from kvq.cache.centring import KeyTransform
    from kvq.cache.prefill import column_intervals, columns, interval_mask, last_column
    from kvq.cache.schedule import visible

    dtype, Tq = queries.dtype, queries.shape[2]
    cache.update_and_fetch(k_new, v_new)
    fresh, cache._fresh = cache._fresh, None  # the chunk the next attend would use (a lab script's shortcut)
    start_q = cache.offset - Tq
    bounds = visible(fresh, start_q, Tq, cache.config.window, cache.config.flush_tokens).tolist()
    parts = cache.parts(Tq, start_q, fresh)
    mean = KeyTransform(cache.key_mean, cache.key_scale)
    keys, values, _ = columns(parts, cache.config, mean, dtype, centre=cache.key_mean is not None)
    end = last_column(parts, 0, Tq)
    return (keys[:, :, :end], values[:, :, :end], interval_mask(parts, 0, Tq, end, dtype), bounds,
            mx.array(column_intervals(parts, 0, Tq)))


def blocks_of(bounds, flush: int) -> tuple[int, int]:
    """``(pad, blocks)``: the rows padded at the front so that the rows sharing a bound fill blocks of
    ``flush``, and the number of blocks."""
    b = np.asarray(bounds)
    first_len = int(np.argmax(b != b[0])) if (b != b[0]).any() else len(b)
    pad = (flush - first_len % flush) % flush
    return pad, -(-(len(b) + pad) // flush)


def block_view(mask: mx.array, pad: int, nb: int, flush: int) -> tuple[mx.array, mx.array, bool]:
    """The full mask ``[T_q, N]`` as a strided view ``[nb, 1, flush, N]`` of a ``[flush, N + (nb - 1) * flush]``
    buffer, blocks in reverse order (block ``nb - 1 - j`` at batch index ``j``, read at column shift
    ``j * flush``). Returns ``(view, dense [nb, 1, flush, N] in the same order, whether the view equals it on
    the real rows)``. Built from the mask itself (numpy), every block writing its real rows."""
    Tq, N = mask.shape
    dtype = mask.dtype
    hidden = np.float32(mx.finfo(dtype).min)
    full = np.full((nb * flush, N), hidden, np.float32)
    full[pad:pad + Tq] = np.array(mask.astype(mx.float32))
    real = np.zeros(nb * flush, bool)
    real[pad:pad + Tq] = True
    width = N + (nb - 1) * flush
    buf = np.full((flush, width), hidden, np.float32)
    for k in range(nb):
        j = nb - 1 - k  # batch index of block k, read at column shift j * flush
        rows = slice(k * flush, (k + 1) * flush)
        keep = real[rows]
        buf[keep, j * flush:j * flush + N] = full[rows][keep]
    blocks = full.reshape(nb, flush, N)[::-1]
    dense = mx.array(np.ascontiguousarray(blocks[:, None])).astype(dtype)
    buf = mx.array(buf).astype(dtype)
    view = mx.as_strided(buf, (nb, 1, flush, N), (flush, 0, width, 1), 0)
    real_rows = mx.array(np.ascontiguousarray(real.reshape(nb, flush)[::-1]))[:, None, :, None]
    same = bool(mx.all(mx.where(real_rows, view == dense, True)).item())
    return view, dense, same


def blocked_queries(queries, pad: int, nb: int, flush: int) -> mx.array:
    B, H, Tq, D = queries.shape
    q = mx.concatenate([mx.zeros((B, H, pad, D), queries.dtype), queries,
                        mx.zeros((B, H, nb * flush - pad - Tq, D), queries.dtype)], axis=2)
    q = q.reshape(H, nb, flush, D)[:, ::-1].transpose(1, 0, 2, 3)
    return mx.contiguous(q)


def unblocked(out, pad: int, Tq: int) -> mx.array:
    nb, H, flush, D = out.shape
    return out[::-1].transpose(1, 0, 2, 3).reshape(1, H, nb * flush, D)[:, :, pad:pad + Tq]


def main(argv=None) -> int:
    ap = layer_parser(__doc__, "8K,32K,128K")
    ap.add_argument("--method", default="turboquant:3")
    ap.add_argument("--warpgroups", type=int, default=None,
                    help="the prefill kernel's form (kvq_metal.knobs.PrefillKnobs.warpgroups: 0 mma.sync, 1 or 2 "
                         "wgmma warpgroups a block on compute capability 9.x; default: the knob's)")
    ap.add_argument("--pipeline", action="store_true",
                    help="the wgmma form's pipelined schedule (kvq_metal.knobs.PrefillKnobs.pipeline)")
    ap.add_argument("--minb", type=int, default=None,
                    help="the prefill kernel's launch bound at --head-dim (kvq_metal.knobs.PrefillKnobs.minb; default: "
                         "the library's)")
    args = ap.parse_args(argv)

    import attrs
    from kvq.bench.fill import fill
    from kvq_metal import prefill
    from kvq_metal.prefill import prefill_attend
    if args.warpgroups is not None:
        prefill.TUNING = attrs.evolve(prefill.TUNING, warpgroups=args.warpgroups)
    if args.pipeline:
        prefill.TUNING = attrs.evolve(prefill.TUNING, pipeline=True)
    if args.minb is not None:
        prefill.TUNING = attrs.evolve(prefill.TUNING, minb={**prefill.TUNING.minb, args.head_dim: args.minb})
    from kvq.evaluation.spec import make_layer_cache, parse_method

    dtype, source = layer_source(args)
    D, C, flush = args.head_dim, args.chunk, 128
    rows = []
    for context in [_size(c) for c in args.contexts.split(",")]:
        q, k_new, v_new, k_all, v_all = layer_inputs(args, source, context)
        cache = make_layer_cache(parse_method(args.method), sinks=4, window=128)
        fill([cache], source, context, C)
        keys, values, mask, bounds, intervals = chunk_inputs(cache, q, k_new, v_new)
        mx.eval(q, k_all, v_all, keys, values, mask)
        scale = D ** -0.5
        sdpa = mx.fast.scaled_dot_product_attention
        pad, nb = blocks_of(bounds, flush)
        view, dense, same = block_view(mask, pad, nb, flush)
        qb = blocked_queries(q, pad, nb, flush)
        kb = mx.broadcast_to(keys, (nb,) + keys.shape[1:])
        vb = mx.broadcast_to(values, (nb,) + values.shape[1:])
        mx.eval(view, dense, qb)
        row = {"context": context, "chunk": C, "keys": keys.shape[2], "blocks": nb, "pad": pad,
               "view_equals_mask": same, "kernel_minb": prefill.TUNING.minb.get(D, 0),
               "kernel_warpgroups": prefill.launch_warpgroups(D),
               # as the launch plan decides it (the pipelined schedule only with wgmma)
               "kernel_pipeline": dict(prefill.launch_plan(q.shape, keys.shape, dtype, 1, scale, False, 0,
                                                           prefill.launch_warpgroups(D),
                                                           prefill.TUNING.pipeline).template)["PIPE"]}
        reference = sdpa(q, keys, values, scale=scale, mask=mask)
        variants = {
            "causal": lambda: sdpa(q, k_all, v_all, scale=scale, mask="causal"),
            "none": lambda: sdpa(q, keys, values, scale=scale),
            "full": lambda: sdpa(q, keys, values, scale=scale, mask=mask),
            "row_broadcast": lambda: sdpa(q, keys, values, scale=scale, mask=mask[-1:]),
            "blocks_view": lambda: unblocked(sdpa(qb, kb, vb, scale=scale, mask=view), pad, C),
            "blocks_dense": lambda: unblocked(sdpa(qb, kb, vb, scale=scale, mask=dense), pad, C),
            "kernel": lambda: prefill_attend(q, keys, values, intervals, scale),
        }
        for name, fn in variants.items():
            try:
                row[f"{name}_s"] = timed(fn, args.reps)
                if name.startswith("blocks") or name in ("full", "kernel"):
                    diff = mx.abs(fn().astype(mx.float32) - reference.astype(mx.float32)).max().item()
                    row[f"{name}_max_abs_diff"] = diff
            except Exception as exc:  # a layout MLX or cuDNN refuses: say so and go on
                row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        write_row(args.out / "prefill_masks.json", rows, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
