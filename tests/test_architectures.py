"""kvq's caches on mlx-lm's own model classes beyond llama and qwen2 (issue #25): tiny random-weight qwen3 (q/k
norms), phi3 (head_dim 96), gemma3 (head_dim 256, five sliding layers to one global), gpt_oss (learned sinks,
alternating sliding layers, MoE), qwen3_moe, a llama with mistral-style sliding layers, and three models whose
layers attend keys of another layer's cache: gemma4_text (its last layers share the KV of earlier ones and attend
them naming no cache), afm7 (KV-reuse layers read the last cache's ``keys_and_values()``) and iquestloopcoder (its
second loop attends the first loop's keys naming its own cache). Layers with a sliding window get kvq's
RotatingKVQCache (tests/test_rotating_cache.py), the others kvq's KVQCache. kvq's fp16 cache gives mlx-lm's logits
(16-bit storage of a float32 model's keys and values: within 3e-3), every method finite logits, and prompt-cache
files round trip mixed layers exactly. Every token past the 4 sinks and the 8-token window is compressed
(``flush=1``: at kvq's default flush of 128 these 43 tokens would all stay in the window)."""

from __future__ import annotations

import importlib
import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache

import kvq

CONFIGS = {
    "qwen3": dict(model_type="qwen3", hidden_size=128, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=128, num_key_value_heads=2,
                  max_position_embeddings=4096, head_dim=64, tie_word_embeddings=True, rope_theta=10000.0),
    "phi3": dict(model_type="phi3", hidden_size=192, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2,
                 rms_norm_eps=1e-5, vocab_size=128, num_key_value_heads=2),
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=128, num_hidden_layers=6, intermediate_size=128,
                        num_attention_heads=2, head_dim=256, num_key_value_heads=1, vocab_size=128, sliding_window=16,
                        sliding_window_pattern=6),
    "gpt_oss": dict(model_type="gpt_oss", num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                    vocab_size=128, hidden_size=128, intermediate_size=128, head_dim=64, num_attention_heads=4,
                    num_key_value_heads=2, sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=128, num_hidden_layers=2, intermediate_size=128,
                      num_attention_heads=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[], moe_intermediate_size=64, rms_norm_eps=1e-6, vocab_size=128,
                      num_key_value_heads=2, head_dim=64, rope_theta=10000.0, tie_word_embeddings=False,
                      max_position_embeddings=4096, norm_topk_prob=True),
    "llama": dict(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128, head_dim=32,
                  layer_types=["sliding_attention", "full_attention"], sliding_window=16, rope_theta=10000.0),
    # six layers (sliding, sliding, full) twice, the last two sharing the KV of layers 3 and 2: four caches
    "gemma4_text": dict(model_type="gemma4_text", hidden_size=64, num_hidden_layers=6, intermediate_size=64,
                        num_attention_heads=2, head_dim=32, global_head_dim=64, num_key_value_heads=1,
                        num_kv_shared_layers=2, vocab_size=128, vocab_size_per_layer_input=128,
                        hidden_size_per_layer_input=16, sliding_window=16, sliding_window_pattern=3),
    "afm7": dict(model_type="afm7", vocab_size=128, hidden_dim=128, num_layers=4, num_kv_reuse_layers=2, num_heads=4,
                 num_kv_heads=2),
    # two caches per layer: the first loop's, then the second loop's sliding window
    "iquestloopcoder": dict(model_type="iquestloopcoder", hidden_size=128, num_hidden_layers=2, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
                            vocab_size=128, loop_window_size=16, rope_theta=10000.0),
}
#: Which layers have a sliding window (kvq's RotatingKVQCache).
SLIDING = {"gemma3_text": [0, 1, 2, 3, 4], "gpt_oss": [0], "llama": [0], "gemma4_text": [0, 1, 3],
           "iquestloopcoder": [2, 3]}
#: Cache options of every kvq cache here: 4 sinks, an 8-token window, and each token compressed as it leaves it.
OPTIONS = dict(window=8, flush=1)
PROMPT = mx.array([[(7 * i + 3) % 128 for i in range(40)]])
#: How far kvq's fp16 cache may move the logits from mlx-lm's float32 caches: 16-bit storage of the float32 models'
#: keys and values (3e-3), except the random gemma3, whose six layers all store 16 bits now that its sliding layers
#: are kvq's too (measured 0.018; against mlx-lm caches that store the same 16 bits, tests/test_rotating_cache.py,
#: within 5e-3), and the random gemma4_text likewise (measured 0.0084; against mlx-lm caches that round keys and
#: values to 16 bits, 1.4e-3).
TOLERANCE = {"gemma3_text": 3e-2, "gemma4_text": 1.5e-2}


def tiny(name: str):
    """A random-weight float32 model of mlx-lm's class ``name`` (:data:`CONFIGS`), the same on every call."""
    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(CONFIGS[name]))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    model = tiny(request.param)
    model.name = request.param
    return model


def run(model, caches, steps=(5, 9, 11)) -> np.ndarray:
    """Last-position logits after a prefill in two chunks (24 + 16 tokens, past the 8-token window) and after each
    of three decode steps."""
    outs = [model(PROMPT[:, :24], cache=caches)[:, -1], model(PROMPT[:, 24:], cache=caches)[:, -1]]
    outs += [model(mx.array([[t]]), cache=caches)[:, -1] for t in steps]
    return np.array(mx.concatenate(outs))


def mlx_caches(model) -> list:
    return model.make_cache() if hasattr(model, "make_cache") else [mlx_cache.KVCache() for _ in model.layers]


def test_fp16_cache_gives_mlx_lm_logits(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # served: no UnservableModelWarning
        caches = kvq.make_prompt_cache(model, "fp16", **OPTIONS)
    sliding = [i for i, c in enumerate(caches) if isinstance(c, kvq.RotatingKVQCache)]
    assert sliding == SLIDING.get(model.name, [])
    assert all(type(c) is kvq.KVQCache for i, c in enumerate(caches) if i not in sliding)
    np.testing.assert_allclose(run(model, caches), run(model, mlx_caches(model)),
                               atol=TOLERANCE.get(model.name, 3e-3))


@pytest.mark.parametrize("method", ["affine:4", "turboquant:4", "turboquant:3"])
def test_every_method_runs(model, method):
    name, bits = method.split(":")
    caches = kvq.make_prompt_cache(model, name, bits=int(bits), **OPTIONS)
    logits = run(model, caches)
    assert np.isfinite(logits).all()
    # full-attention layers hold 43 tokens: 4 sinks, 8 in the window, the rest compressed
    assert all(c.compressed_keys.length == 31 for c in caches if type(c) is kvq.KVQCache)


def test_prompt_cache_files_round_trip_mixed_layers(model, tmp_path):
    caches = kvq.make_prompt_cache(model, "affine", bits=4, **OPTIONS)
    run(model, caches, steps=())
    path = str(tmp_path / "cache.safetensors")
    kvq.save_prompt_cache(path, caches)
    loaded = kvq.load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    step = mx.array([[17]])
    np.testing.assert_array_equal(np.array(model(step, cache=loaded)), np.array(model(step, cache=caches)))
