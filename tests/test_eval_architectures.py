"""``kvq eval`` and ``kvq bench`` on models with sliding-window layers and learned attention sinks (issue #25):
tiny random gemma3 (five sliding layers of window 16 to one global, head_dim 256) and gpt_oss (a sliding layer,
learned sink logits).

Before, the attention-error step read the reference's keys from its caches: a sliding layer's cache holds only its
window, so it crashed (mlx-lm's rotating cache) or compared against the wrong tokens (the fp16 reference itself
showed errors of 0.51 on gemma3), and mlx-affine gave every layer a QuantizedKVCache, which let sliding layers see
the whole context. Now the reference records every key and value its caches are given, each sliding layer is
replayed into a rotating cache of its size and compared with attention over what mlx-lm's rotating cache shows each
query, and the sink logits are part of both sides."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache
from test_architectures import tiny

import kvq
from kvq.cli import eval_cmd
from kvq.evaluation import EvalSettings, Evaluation
from kvq.evaluation.attention_error import InputRecorder, dense_kv, window_mask
from kvq.evaluation.spec import make_cache, parse_methods

#: Which layers slide (mlx-lm's RotatingKVCache(16, 0)) in the tiny models of tests/test_architectures.py.
SLIDING = {"gemma3_text": [0, 1, 2, 3, 4], "gpt_oss": [0]}
CONTEXT, SCORED = 96, 32


def evaluate(model, methods: str) -> dict[str, dict]:
    """Rows of one window of 96 context tokens (prefill chunks of 32) and 32 scored tokens, by method label."""
    settings = EvalSettings(CONTEXT, windows=1, score_tokens=SCORED, chunk=32, sinks=4, window=8, needle_depths=(),
                            progress=False)
    ids = [(7 * i + 3) % 128 for i in range(400)]
    rows = Evaluation(model, None, ids, settings).run(parse_methods(methods, sinks=4, window=8))
    return {row["method"]: row for row in rows}


@pytest.mark.parametrize("name", list(SLIDING))
def test_attention_error_of_sliding_and_sink_layers(name):
    """The fp16 cache replays into the reference (error below 1e-5 at every layer, sliding ones included: the
    rotating replay and :func:`window_mask` show each query the same tokens); compressed methods have finite
    errors of their usual size; an mlx-affine row keeps mlx-lm's RotatingKVCache on sliding layers (mlx-lm cannot
    quantize it) and quantizes the others (gemma3; gpt-oss's sink logits are refused, see below)."""
    model = tiny(name)
    methods = "fp16,turboquant:4,affine:4" + (",mlx-affine:4" if name == "gemma3_text" else "")
    rows = evaluate(model, methods)
    fp16 = rows["kvcache"]["attention_error"]["per_layer"]
    assert len(fp16) == len(model.layers) and max(fp16) < 1e-5, fp16  # float32 summation order (measured 1.5e-7)
    for label in ("turboquant:4", "affine:4"):
        errors = rows[label]["attention_error"]["per_layer"]
        assert all(0 < e < 0.25 for e in errors), (label, errors)
        assert np.isfinite(rows[label]["ppl_change"]) and np.isfinite(rows[label]["kl"])  # (random models: no size)
    if name == "gemma3_text":
        errors = rows["mlx-affine:4"]["attention_error"]["per_layer"]
        # sliding layers: mlx-lm's float32 rotating cache against the 16-bit reference keys (measured 0, 4e-7)
        assert all(errors[i] < 1e-4 for i in SLIDING[name]), errors
        assert errors[5] > 1e-3  # the global layer holds 4-bit keys and values
        caches = make_cache(model, parse_methods("mlx-affine:4")[1], 4, 8)
        kinds = [type(c) for c in caches]
        assert kinds == [mlx_cache.RotatingKVCache] * 5 + [mlx_cache.QuantizedKVCache]


def test_window_mask_is_what_mlx_lm_rotating_cache_shows_in_decode():
    """Token by token through mlx-lm's RotatingKVCache(6, keep=2): the keys each query attends (the cache's tokens,
    read back from their values' tags) are those :func:`window_mask` marks."""
    cache = mlx_cache.RotatingKVCache(6, keep=2)
    seen = []
    for t in range(14):
        tag = mx.full((1, 1, 1, 4), float(t))
        _, values = cache.update_and_fetch(tag, tag)
        seen.append(sorted(int(x) for x in np.array(values[0, 0, :, 0])))
    mask = np.array(window_mask(14, 14, 6, 2))
    assert [list(np.flatnonzero(row)) for row in mask] == seen


def test_recorded_keys_of_a_full_layer_are_what_the_fp16_cache_holds():
    """The reference's recorded inputs, rounded as kvq's 16-bit buffers round them, equal what kvq's fp16 cache
    decodes for a layer that sees every token (the keys the attention error used before)."""
    model = tiny("gpt_oss")
    caches = kvq.make_prompt_cache(model, "fp16", sinks=4, window=8)
    recorder = InputRecorder(caches)
    ids = mx.array([[(7 * i + 3) % 128 for i in range(40)]])
    model(ids[:, :24], cache=caches)
    model(ids[:, 24:], cache=caches)
    recorder.detach()
    keys, values = recorder.kv()[1]  # layer 1: full attention
    decoded_keys, decoded_values = dense_kv(caches[1])
    assert keys.shape == (1, 2, 40, 64)
    assert mx.array_equal(keys, decoded_keys).item() and mx.array_equal(values, decoded_values).item()
    assert "update_and_fetch" not in vars(caches[1])  # detached: the class's method again


def test_mlx_affine_on_a_model_with_sink_logits_is_refused_before_any_work():
    model = tiny("gpt_oss")
    with pytest.raises(ValueError, match="mlx-affine:4.*attention sinks.*leave mlx-affine out"):
        eval_cmd._check_mlx_sinks(parse_methods("fp16,mlx-affine:4"), model)
    eval_cmd._check_mlx_sinks(parse_methods("fp16,affine:4"), model)  # kvq's caches serve sink logits
    eval_cmd._check_mlx_sinks(parse_methods("fp16,mlx-affine:4"), tiny("gemma3_text"))  # no sinks: allowed


def test_bench_reference_caches_and_replay_on_a_sliding_model():
    """``kvq bench``: the fp16 reference is what mlx-lm makes for the model (RotatingKVCache on the sliding layers,
    not a KVCache that would let them see everything), mlx-affine quantizes only the plain layers, and a replay
    fill records every token of every layer from a run in which sliding layers saw their window."""
    from kvq.bench.e2e import E2ESettings
    from kvq.bench.e2e import make_cache as bench_cache
    from kvq.bench.fill import ReplayKV

    model = tiny("gemma3_text")
    settings = E2ESettings(contexts=(64,))
    reference = bench_cache(model, parse_methods("fp16")[0], settings)
    assert [type(c) for c in reference] == [mlx_cache.RotatingKVCache] * 5 + [mlx_cache.KVCache]
    quantized = bench_cache(model, parse_methods("fp16,mlx-affine:4")[1], settings)
    assert [type(c) for c in quantized] == [mlx_cache.RotatingKVCache] * 5 + [mlx_cache.QuantizedKVCache]
    ids = mx.array([(7 * i + 3) % 128 for i in range(40)])
    replay = ReplayKV(model, ids)
    caches = model.make_cache()  # the same run by hand: mlx-lm's caches, 40 tokens in one chunk
    model(ids[None], cache=caches)
    for layer in (0, 5):
        keys, values = replay(layer, 0, 40)
        assert keys.shape == (1, 1, 40, 256)
        # a first chunk: the rotating cache keeps it whole
        assert mx.array_equal(keys, caches[layer].keys[:, :, :40]).item()
        assert mx.array_equal(values, caches[layer].values[:, :, :40]).item()
