"""The MLX graph a batch's first prefill chunk builds per layer (mlx-lm's ``BatchGenerator``: prompts prefilled as
one batch of ``BatchKVQCache`` rows), counted on the CPU with the CUDA path emulated (issue #51).

For each method, ``--batch`` rows of one layer (random keys and values, Llama-3-8B's KV shape) store a first chunk
of ``--chunk`` tokens and attend it (32 query heads): the graph's nodes are counted by primitive
(``mx.export_to_dot``) for the first blocks' guard decisions (what each row's chunk queued with ``mx.async_eval``:
:func:`kvq.cache.guard.decide_ahead`, and the mean and scales it compresses with) and for the update and attention
together (the batch's attention output), nothing evaluated. Each node is work MLX's evaluation walks and, for most,
a kernel it encodes and launches: on an H100 about 10-15 us of host time each
(``benchmarks/results/prefill/2026-12-07-h100-host-profile-d05440f``), while fp16's device time for a layer of 8
rows of 2,048 is about 11 ms. ``chunk_graph.py``'s ``--emulate-cuda`` is used: kvq takes its CUDA path (fused
kernels as single nodes, the decoded copy attended in one fused call per batch or row), MLX builds the CPU's forms
of its own ops (its fused attention decomposes: an upper bound there).

    python benchmarks/investigations/batch_chunk_graph.py OUT.json [--methods turboquant:3,affine:4] [--batch 8]
        [--chunk 2048] [--lengths 2048,1900,...]

``--lengths`` gives each row's prompt length instead (at most ``--chunk``; the batch is their count): prompts of
different lengths in one chunk, right-padded to the longest as ``BatchGenerator`` pads them
(``BatchKVQCache.prepare``), so each row stores its own number of tokens, as a server's batch does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from chunk_graph import emulate_cuda, node_counts  # noqa: E402


def measure(method: str, batch: int, chunk: int, lengths: list | None = None) -> dict:
    """One method's row: the guard's nodes and the update's and attention's, for ``batch`` rows' first chunk
    (``lengths``: each row's real tokens of the chunk, right padding after them; ``None``: ``chunk`` each)."""
    from kvq.bench.fill import RandomKV
    from kvq.cache import KVQCache
    from kvq.cache.batch import BatchKVQCache
    from kvq.evaluation.spec import make_layer_cache, parse_method

    tokens = chunk if lengths is None else max(lengths)  # BatchGenerator pads to the longest prompt
    source = RandomKV(8, 128, mx.bfloat16)
    pieces = [source(b, 0, tokens) for b in range(batch)]
    keys, values = mx.concatenate([k for k, _ in pieces]), mx.concatenate([v for _, v in pieces])
    queries = mx.random.normal((batch, 32, tokens, 128), mx.bfloat16, key=mx.random.key(1))
    mx.eval(keys, values, queries)
    cache = BatchKVQCache([make_layer_cache(parse_method(method), sinks=4, window=128) for _ in range(batch)])
    if lengths is not None and len(set(lengths)) > 1:
        cache.prepare(lengths=lengths, right_padding=[tokens - n for n in lengths])
    queued = []
    async_eval = mx.async_eval
    mx.async_eval = lambda *arrays: queued.extend(a for a in arrays if isinstance(a, mx.array))
    try:
        cache.update_and_fetch(keys, values)
        guard = []
        for row in cache.rows:
            ahead = row._ahead[0] if isinstance(row, KVQCache) and row._ahead is not None else None
            if ahead is not None:
                guard += ahead.block.arrays() + [ahead.mean] + ([] if ahead.scales is None else [ahead.scales])
        guard_nodes = node_counts(guard) if guard else {}
        out = cache.attend(queries, 128 ** -0.5)
        chunk_nodes = node_counts([out])
    finally:
        mx.async_eval = async_eval
    return {"method": method, "batch": batch, "chunk": chunk, "lengths": lengths, "guard_nodes": guard_nodes,
            "guard_node_total": sum(guard_nodes.values()), "chunk_nodes": chunk_nodes,
            "chunk_node_total": sum(chunk_nodes.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--methods", default="turboquant:3,turboquant:4,affine:4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--lengths", default=None, help="each row's prompt length, comma-separated (at most --chunk)")
    args = ap.parse_args(argv)
    lengths = None if args.lengths is None else [int(n) for n in args.lengths.split(",")]
    if lengths is not None and not all(0 < n <= args.chunk for n in lengths):
        ap.error(f"--lengths: each must be in 1..--chunk ({args.chunk}); got {args.lengths}")
    batch = args.batch if lengths is None else len(lengths)
    emulate_cuda()
    rows = []
    for method in [m.strip() for m in args.methods.split(",")]:
        row = measure(method, batch, args.chunk, lengths)
        rows.append(row)
        shape = f"{batch} rows x {args.chunk}" if lengths is None else f"rows of {args.lengths}"
        print(f"{method:14s} {shape}: guard {row['guard_node_total']:5d} nodes, "
              f"update and attention {row['chunk_node_total']:5d} nodes", flush=True)
    import kvq

    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(kvq.__file__).parent).stdout.strip()  # of the kvq measured
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "emulated_cuda": True, "mlx": mx.__version__, "revision": revision,
                                    "command": " ".join(sys.argv)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
