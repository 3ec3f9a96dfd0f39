"""Issue #49: mlx-lm's sorted expert GEMM against the unsorted one, computed in the same graph.

mlx-lm's ``SwitchGLU`` sorts a call's token-expert pairs by expert once there are 64 or more and calls
``gather_mm(..., sorted_indices=True)``, which MLX's CUDA back end runs as CUTLASS's grouped GEMM. This script wraps
``SwitchGLU`` so that every sorting call also computes the unsorted result of the same inputs, and reports, per
iteration, the largest difference, whether the ``argsort`` that ordered the pairs was a sorted permutation, and
which pairs differ. Modes:

- ``kvq``: the tiny gpt_oss of tests/test_rotating_cache.py, its chunked-prefill check (token by token, one chunk of
  50 tokens, chunks 9/1/23/17) with kvq's affine:4 caches; ``--kernels off`` for pure MLX.
- ``mlx-lm``: the same model, a 50-token prefill with mlx-lm's own caches.
- ``bare``: no model and no cache: one ``SwitchGLU`` on fixed inputs (100 pairs, 4 experts), buffers of random
  sizes allocated between calls, each result compared with the unsorted result computed once.

Start several copies at once to load the GPU (see gpu_chunk_flake.md)::

    python benchmarks/investigations/sorted_expert_gemm.py kvq --n 40

Run from the repository root (it imports the tests' helpers).
"""

from __future__ import annotations

import argparse
import random
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.models import switch_layers

sys.path.insert(0, "tests")
from test_architectures import tiny  # noqa: E402
from test_rotating_cache import PROMPT, logits  # noqa: E402

import kvq  # noqa: E402

SORTED = switch_layers.SwitchGLU.__call__
RECORDS: list[tuple[mx.array, mx.array, mx.array]] = []  # (|sorted - unsorted| per pair, indices, order)


def unsorted(glu, x, indices):
    """``SwitchGLU`` through ``gather_mm`` without sorting: ``x [B, T, D]``, ``indices [B, T, top_k]``."""
    x = mx.expand_dims(x, (-2, -3))
    gate = glu.gate_proj(x, indices)
    return glu.down_proj(glu.activation(glu.up_proj(x, indices), gate), indices).squeeze(-2)


def checked(glu, x, indices):
    """The sorted call as mlx-lm makes it, with its difference from the unsorted one recorded."""
    orders = []
    argsort = mx.argsort

    def recording_argsort(a, *args, **kwargs):
        out = argsort(a, *args, **kwargs)
        orders.append(out)
        return out

    mx.argsort = recording_argsort
    try:
        out = SORTED(glu, x, indices)
    finally:
        mx.argsort = argsort
    if orders:  # mlx-lm sorted: orders[0] is the order it gathered the pairs in
        RECORDS.append((mx.abs(out - unsorted(glu, x, indices)).max(-1), indices, orders[0]))
    return out


def report(it: int) -> bool:
    """Print iteration ``it``'s records; True when a sorted result differs by more than 1e-4."""
    bad = False
    for diff, indices, order in RECORDS:
        diff, flat, order = np.array(diff).reshape(-1), np.array(indices).reshape(-1), np.array(order)
        ordered = bool((np.diff(flat[order].astype(np.int64)) >= 0).all())
        permutation = bool((np.sort(order) == np.arange(order.size)).all())
        rows = np.nonzero(diff > 1e-4)[0]
        line = f"{it} max {diff.max():.2e} argsort sorted={ordered} permutation={permutation}"
        if rows.size:
            line += (f" pairs off {rows.size}/{diff.size} (first {rows[:6].tolist()}), pairs per expert "
                     f"{np.bincount(flat).tolist()}")
        print(line, flush=True)
        bad |= rows.size > 0
    RECORDS.clear()
    return bad


def bare(n: int) -> int:
    """No model, no cache: the sorted call on fixed inputs against the unsorted result computed once."""
    glu = tiny("gpt_oss").model.layers[0].mlp.experts
    x = mx.random.normal((1, 50, 128), key=mx.random.key(1))
    indices = mx.random.randint(0, 4, (1, 50, 2), key=mx.random.key(2)).astype(mx.uint32)
    ref = unsorted(glu, x, indices)
    mx.eval(ref)
    kept, bad = [], 0
    for it in range(n):
        for _ in range(random.randint(1, 20)):
            a = mx.random.normal((random.randint(1, 1 << 16),)) * 1000
            mx.eval(a)
            kept = (kept + [a])[-30:] if random.random() < 0.3 else kept
        out = SORTED(glu, x, indices)
        mx.async_eval(out)
        mx.eval(mx.random.normal((random.randint(1, 1 << 16),)))
        diff = float(mx.abs(out - ref).max())
        bad += diff > 1e-4
        print(it, f"max {diff:.2e}", flush=True)
    return bad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("kvq", "mlx-lm", "bare"))
    p.add_argument("--n", type=int, default=40, help="iterations")
    p.add_argument("--kernels", default="auto", choices=("auto", "off"), help="kvq's kernels (mode kvq)")
    a = p.parse_args()
    if a.mode == "bare":
        bad = bare(a.n)
    else:
        switch_layers.SwitchGLU.__call__ = checked
        model, bad = tiny("gpt_oss"), 0
        for it in range(a.n):
            if a.mode == "kvq":
                for chunks in ([1] * 50, (50,), (9, 1, 23, 17)):
                    caches = kvq.make_prompt_cache(model, "affine", bits=4, window=4, flush=3, kernels=a.kernels)
                    logits(model, caches, chunks, steps=4)
            else:
                mx.eval(model(mx.array([PROMPT])[:, :50], cache=model.make_cache()))
            bad += report(it)
    print(f"RESULT {a.mode}: {bad}/{a.n} iterations with a sorted result off by more than 1e-4", flush=True)


if __name__ == "__main__":
    main()
