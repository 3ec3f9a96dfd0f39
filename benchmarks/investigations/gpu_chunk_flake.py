"""Issue #49: the gpt_oss chunked-prefill check (tests/test_rotating_cache.py) that fails now and then on CUDA.

Repeats the test's three runs (token by token, one chunk of 50, chunks 9/1/23/17) ``N`` times in one process on
the tiny random gpt_oss and prints, per iteration, each run's largest logit difference from the first token-by-token
run; the last line counts the iterations off by more than the test's 5e-4. Start several copies at once to load
the GPU (the failure rate grows with load: see gpu_chunk_flake.md)::

    python benchmarks/investigations/gpu_chunk_flake.py affine:4 [auto|off] [N] [model]

``auto``/``off`` is the cache's ``kernels`` argument. Run from the repository root (it imports the tests' helpers).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

sys.path.insert(0, "tests")
from test_architectures import tiny  # noqa: E402
from test_rotating_cache import logits  # noqa: E402

import kvq  # noqa: E402

CHUNKS = ([1] * 50, (50,), (9, 1, 23, 17))


def main(method: str = "affine:4", kernels: str = "auto", n: int = 40, name: str = "gpt_oss") -> int:
    base_method, _, bits = method.partition(":")
    params = {"bits": int(bits)} if bits else {}
    model = tiny(name)
    first, bad = None, 0
    for it in range(n):
        runs = [logits(model, kvq.make_prompt_cache(model, base_method, window=4, flush=3, kernels=kernels,
                                                    **params), chunks, steps=4) for chunks in CHUNKS]
        first = runs[0] if first is None else first
        errors = [float(np.abs(run[-5:] - first[-5:]).max()) for run in runs]
        bad += max(errors) > 5e-4
        print(it, " ".join(f"{e:.1e}" for e in errors), flush=True)
    print(f"RESULT {method} kernels={kernels} {name}: {bad}/{n} iterations off by more than 5e-4", flush=True)
    return bad


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("method", nargs="?", default="affine:4")
    p.add_argument("kernels", nargs="?", default="auto", choices=("auto", "off", "require"))
    p.add_argument("n", nargs="?", type=int, default=40)
    p.add_argument("model", nargs="?", default="gpt_oss")
    a = p.parse_args()
    main(a.method, a.kernels, a.n, a.model)
