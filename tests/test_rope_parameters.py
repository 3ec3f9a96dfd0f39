"""A config with RoPE only in transformers' ``rope_parameters`` (no top-level ``rope_theta``) loads with the base it
gives, not mlx-lm's default (issue #54): kvq.models.rope.rope_overrides, applied by kvq.models.load with a warning."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gemma3_text, llama

import kvq.models
from kvq.models.rope import rope_overrides

LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64, tie_word_embeddings=False)


def _logits(config: dict) -> np.ndarray:
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    return np.array(model(mx.array([list(range(40))])))


def test_the_flat_form_gives_mlx_lm_the_base_it_states():
    config = {**LLAMA, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}
    assert rope_overrides(config) == {"rope_theta": 500000.0}
    want = _logits({**LLAMA, "rope_theta": 500000.0})
    assert np.array_equal(_logits({**config, **rope_overrides(config)}), want)
    assert np.abs(_logits(config) - want).max() > 1e-3  # what mlx-lm alone loads: base 10000


def test_the_per_layer_type_form_and_scaling():
    config = {"model_type": "gemma3_text", "rope_parameters": {
        "full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}}
    assert rope_overrides(config) == {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                      "rope_local_base_freq": 1e4}
    assert gemma3_text.ModelArgs.from_dict({**config, **rope_overrides(config)}).rope_local_base_freq == 1e4


def test_nothing_to_do_or_mlx_lm_reads_it_itself():
    assert rope_overrides({**LLAMA, "rope_theta": 1e4, "rope_parameters": {"rope_theta": 5e5}}) == {}
    assert rope_overrides(LLAMA) == {}
    # gemma4's class reads rope_parameters itself
    assert rope_overrides({"model_type": "gemma4_text", "rope_parameters": {"rope_theta": 5e5}}) == {}
    with pytest.raises(ValueError, match="rope_parameters must be a dict"):
        rope_overrides({**LLAMA, "rope_parameters": 5e5})
    with pytest.raises(ValueError, match="rope_theta must be a number"):
        rope_overrides({**LLAMA, "rope_parameters": {"rope_theta": "big"}})


def test_load_passes_them_to_mlx_lm_and_says_so(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "rope_parameters": {"rope_theta": 500000.0}}))
    seen = {}

    def fake_load(path, model_config=None, **kwargs):
        seen["model_config"] = model_config
        return "model", "tokenizer"

    monkeypatch.setattr("mlx_lm.load", fake_load)
    with pytest.warns(kvq.models.RopeParametersWarning, match="rope_theta.: 500000.0"):
        assert kvq.models.load(tmp_path) == ("model", "tokenizer")
    assert seen["model_config"] == {"rope_theta": 500000.0}
