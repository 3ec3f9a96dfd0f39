"""A reproduction of the batched decode step's wait with MLX alone (issue #52: the program measured has no kvq cache
and no mlx-lm model; kvq only times it): a toy decoder whose step is an embedding lookup of the last tokens ``[B,
1]`` int32, ``--layers`` of a matmul over a ``--width``-wide weight, RoPE, attention over one shared ``[B, 8,
--context, 128]`` cache (so the device's step grows with the batch, as a decode step's does) and a Python float
(host-made scalars, as a model's step has), an lm_head and an argmax; decoded pipelined as ``mlx_lm.generate`` does
(build step n + 1, ``mx.async_eval`` it, then read step n's tokens), timed by ``benchmarks/decode_host_split.py``'s
``split``: for each batch the median ms of the pipelined build, of ``mx.async_eval`` and of the wait for the tokens,
of a build with nothing in flight and of a step evaluated alone. A build much longer pipelined than alone waited for
the device.

    python benchmarks/investigations/mlx_batch_wait.py [--batches 1,2,3,4,32] [--layers 32] [--width 4096]

What it tests (benchmarks/results/host/README.md, 2026-12-07): whether the wait appears from three sequences on,
where the tokens (12 bytes and more) leave MLX's 8-byte pool of managed memory; ``--rounds`` repeats each batch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parents[1]))  # benchmarks/, for decode_host_split's timing of a step


class ToyDecoder:
    """``model(y, cache=cache) -> logits [B, 1, V]``, as :func:`decode_host_split.split` calls a model: ``y`` the
    last tokens ``[B, 1]`` int32, ``cache`` the shared ``[B, 8, T, 128]`` keys and values every layer attends."""

    def __init__(self, layers: int, width: int, vocab: int) -> None:
        self.width = width
        self.embed = (mx.random.normal((vocab, width)) * 0.02).astype(mx.bfloat16)
        self.weights = [(mx.random.normal((width, width)) * width ** -0.5).astype(mx.bfloat16) for _ in range(layers)]
        self.head = (mx.random.normal((width, vocab)) * width ** -0.5).astype(mx.bfloat16)
        self.offset = 0
        mx.eval(self.embed, self.head, *self.weights)

    def __call__(self, y: mx.array, cache: mx.array) -> mx.array:
        h = self.embed[y]  # [B, 1, D]
        for w in self.weights:
            h = h @ w
            heads = h.reshape(h.shape[0], 1, self.width // 128, 128).transpose(0, 2, 1, 3)
            heads = mx.fast.rope(heads, 128, traditional=False, base=500000.0, scale=1.0, offset=self.offset)
            heads = mx.fast.scaled_dot_product_attention(heads, cache, cache, scale=128 ** -0.5)
            h = heads.transpose(0, 2, 1, 3).reshape(h.shape) * 0.5 + h * 0.5  # Python floats: host-made scalars
        self.offset += 1
        return h @ self.head


def main() -> None:
    from decode_host_split import split

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,3,4,32")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = ToyDecoder(args.layers, args.width, args.vocab)
    rows = []
    for _ in range(args.rounds):
        for batch in [int(b) for b in args.batches.split(",")]:
            cache = (mx.random.normal((batch, 8, args.context, 128)) * 0.5).astype(mx.bfloat16)
            mx.eval(cache)
            row = {"batch": batch, **split(model, cache, args.steps, warmup=4, batch=batch)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del cache
            mx.clear_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
