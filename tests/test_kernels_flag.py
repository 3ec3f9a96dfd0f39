"""The three-state kernel preference (issue #11): ``kernels="auto" | "require" | "off"``.

On a machine without a GPU no kernel supports anything, so ``auto`` and ``off`` choose pure MLX and give identical
tokens, and ``require`` raises at construction naming what is missing. The GPU half (``auto`` and ``off`` give
the same tokens with kernels active) is in tests/test_kernels_gpu.py.
"""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import kvq
from kvq.selection import KERNELS

from conftest import tiny_llama

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="CPU semantics of the kernels flag")


def _tokens(model, cache, prompt, n=8):
    out = []
    for (token, _), _ in zip(generate_step(prompt, model, prompt_cache=cache, max_tokens=n), range(n)):
        out.append(int(token))
    return out


def test_kernels_values_are_validated():
    with pytest.raises(ValueError, match="kernels must be one of auto, require, off; got 'yes'"):
        kvq.select("turboquant", (1, 2, 64, 64), kernels="yes")
    model = tiny_llama(hidden=128, layers=1, heads=2, kv_heads=1, dtype=mx.float32)
    with pytest.raises(ValueError, match="kernels must be one of"):
        kvq.make_prompt_cache(model, "affine", kernels=True)
    assert KERNELS == ("auto", "require", "off")


@pytest.mark.parametrize("method", ["affine", "turboquant"])
def test_require_raises_at_construction_on_cpu(method):
    model = tiny_llama(hidden=128, layers=1, heads=2, kv_heads=1, dtype=mx.float32)
    with pytest.raises(ValueError, match=rf"kernels='require': no kernel serves '{method}' op 'attend'.*cpu"):
        kvq.make_prompt_cache(model, method, bits=4, kernels="require")
    with pytest.raises(ValueError, match="kernels='require'"):
        kvq.select(method, (1, 2, 4096, 64), op="attend", kernels="require")


def test_require_rejects_mixed_methods():
    model = tiny_llama(hidden=128, layers=1, heads=2, kv_heads=1, dtype=mx.float32)
    with pytest.raises(ValueError, match="one method"):
        kvq.make_prompt_cache(model, key_method="qjl", value_method="affine", method=None, kernels="require")


def test_off_and_auto_choose_pure_mlx_and_agree():
    for kernels in ("auto", "off"):
        plan = kvq.select("turboquant", (1, 2, 4096, 64), op="attend", kernels=kernels)
        assert plan.choices["attend"].backend == "mlx"
    model = tiny_llama(hidden=128, layers=2, heads=4, kv_heads=2, dtype=mx.float32, seed=3)
    prompt = mx.array([1, 5, 9, 33, 2, 7, 120, 64, 3, 11] * 4)
    runs = {k: _tokens(model, kvq.make_prompt_cache(model, "turboquant", bits=3, sinks=2, window=8, kernels=k),
                       prompt) for k in ("auto", "off")}
    assert runs["auto"] == runs["off"] and len(runs["off"]) == 8
