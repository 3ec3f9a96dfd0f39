"""A bits budget (``bits=3.5``, ``turboquant:3.5``): the settings each layer stores, their bytes, and that they
hold through chunking, prompt-cache files and construction (kvq.cache.budget, issue #53)."""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_llama

import kvq
from kvq.cache import KVQCache, load_prompt_cache, make_config, make_prompt_cache, save_prompt_cache
from kvq.cache.budget import KEY_LEAD, spend
from kvq.evaluation.spec import bits_per_coordinate, parse_method


def _bits(params, head_dim):
    return params.accounting(head_dim).bits_per_coordinate


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_turboquant_offers_more_bits_for_less_error(head_dim):
    """Each setting a budget may pick stores more bits per token than the one before and has a smaller expected
    error (the Lloyd-Max D_mse of its two groups, weighted by their coordinates); whole bits are among them."""
    options = kvq.make_params("turboquant").budget_options(head_dim)
    bits = [_bits(p, head_dim) for p in options]
    assert bits == sorted(set(bits))
    plain = {p.bits for p in options if p.outlier_channels == 0}
    assert plain == {1, 2, 3, 4}
    for p in options:
        assert p.outlier_channels % 8 == 0 and abs(p.outlier_bits - p.bits) <= 1


@pytest.mark.parametrize("head_dim, keys, values", [
    # gemma-3 (256): 4-bit keys, values 3-bit with 32 rotated coordinates at 2 (norms counted: 4.0625 + 2.9375)
    (256, (4, 4, 0), (3, 2, 32)),
    (128, (4, 4, 0), (3, 2, 32)),
    # 64: settings 0.5 bits apart; (3.75, 3.25) and (4.25, 2.75) both lead by 0.5 from KEY_LEAD: more key bits
    (64, (4, 4, 0), (2, 3, 32)),
])
def test_a_budget_buys_the_most_bits_that_fit_with_keys_ahead(head_dim, keys, values):
    kp, vp = spend(3.5, kvq.make_params("turboquant"), kvq.make_params("turboquant"), (head_dim, head_dim))
    assert (kp.bits, kp.outlier_bits, kp.outlier_channels) == keys
    assert (vp.bits, vp.outlier_bits, vp.outlier_channels) == values
    assert (_bits(kp, head_dim) + _bits(vp, head_dim)) / 2 == pytest.approx(3.5)
    assert _bits(kp, head_dim) - _bits(vp, head_dim) >= KEY_LEAD


@pytest.mark.parametrize("budget", [1.3, 2.5, 3.2, 3.5, 3.9, 4.1])
def test_no_pair_of_settings_that_fits_stores_more(budget):
    """The pair chosen is the most bits under the budget: checked against every pair of options."""
    base = kvq.make_params("turboquant", seed=3)
    kp, vp = spend(budget, base, base, (128, 128))
    got = (_bits(kp, 128) + _bits(vp, 128)) / 2
    options = [_bits(p, 128) for p in base.budget_options(128)]
    fits = [(a + b) / 2 for a in options for b in options if (a + b) / 2 <= budget + 1e-9]
    assert got <= budget + 1e-9 and got == pytest.approx(max(fits))
    assert kp.seed == vp.seed == 3  # fields that are not about bits are kept


def test_budget_errors_name_the_argument_and_the_method():
    with pytest.raises(ValueError, match="affine takes whole bits only"):
        make_config("affine", bits=3.5)
    with pytest.raises(ValueError, match="bits must be a number above 0"):
        make_config("turboquant", bits=-0.5)
    with pytest.raises(ValueError, match=r"below the fewest bits .* head_dims \(64, 64\): 1.25"):
        make_config("turboquant", bits=0.5).within_budget(64, 64)
    with pytest.raises(ValueError, match="outlier_select='rotated'"):
        make_config("turboquant", bits=3.5, outlier_select="data", outlier_channels=8).within_budget(64, 64)
    assert make_config("turboquant", bits=4.0) == make_config("turboquant", bits=4)  # a whole number is bits
    # a whole number out of range says where a fraction of a bit would go (a new user tried bits=5, then 4.5)
    with pytest.raises(ValueError, match=r"got 5 \(turboquant's codes take whole bits; a number with a fraction, "
                                         r"such as 3\.5, is a bits budget per layer"):
        make_config("turboquant", bits=5)
    # a budget just above the most (4.25 at head_dim 64) buys the most; one more than a bit above it is refused, as
    # bits=5 is (a new user's bits=9.5 was stored at 4.25 bits and labelled a budget of 9.5)
    kp = make_config("turboquant", bits=4.5).within_budget(64, 64).key_params
    assert (kp.bits, kp.outlier_channels) == (4, 0)
    with pytest.raises(ValueError, match=r"bits budget 9.5 is more than 1 bit above the most bits per coordinate "
                                         r"turboquant keys and turboquant values store at head_dims \(64, 64\): "
                                         r"4.25; .* give at most 4.25"):
        make_config("turboquant", bits=9.5).within_budget(64, 64)


def test_a_budget_cache_stores_the_bytes_it_promises():
    """A cache built from the configuration alone chooses at its first update; the compressed tokens' bytes
    are what the accounting of the settings chosen says (norms and partial words counted)."""
    cache = KVQCache(make_config("turboquant", bits=3.5, sinks=0, window=0, flush=1))
    keys, values = mx.random.normal((1, 2, 64, 128)), mx.random.normal((1, 2, 64, 128))
    cache.update_and_fetch(keys, values)
    kp, vp = cache.config.key_params, cache.config.value_params
    assert cache.config.budget == 3.5 and (kp.bits, vp.bits, vp.outlier_channels) == (4, 3, 32)
    stored = sum(a.nbytes // a.shape[2] * 64 for s in (cache.compressed_keys, cache.compressed_values)
                 for a in s.data.values())
    assert cache.compressed_keys.length == 64
    assert stored * 8 / (2 * 64 * 2 * 128) == pytest.approx(3.5)


def test_make_prompt_cache_chooses_at_construction_and_files_keep_the_choice(tmp_path):
    model = tiny_llama(hidden=256, heads=2, kv_heads=1, dtype=mx.float32)  # head_dim 128
    cache = make_prompt_cache(model, "turboquant", bits=3.5, window=16, flush=16)
    assert [(c.config.key_params.bits, c.config.value_params.outlier_channels) for c in cache] == [(4, 32)] * 2
    prompt = mx.array([(5 * i + 1) % 256 for i in range(80)])[None]
    logits = model(prompt, cache=cache)
    save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"), expect=make_config("turboquant", bits=3.5))
    assert [c.config for c in loaded] == [c.config for c in cache]
    step = mx.array([[7]])
    a, b = model(step, cache=cache), model(step, cache=loaded)
    assert np.array_equal(np.array(a), np.array(b)) and logits.shape[1] == 80


def test_eval_method_string_is_a_budget():
    spec = parse_method("turboquant:3.5")
    assert spec.cache_options == {"bits": 3.5} and spec.key_params == {}
    assert bits_per_coordinate(spec, 256) == (4.0625, 2.9375)
    assert parse_method("turboquant:4.0").key_params == {"bits": 4}
    with pytest.raises(ValueError, match="budget in bits per coordinate"):
        parse_method("turboquant:3.5.1")


def test_rows_with_one_budget_pack():
    """Rows of one budget have one set of settings (the choice uses no data), so they pack."""
    from kvq.cache.packable import packable

    rows = []
    for seed in (0, 1):
        row = KVQCache(make_config("turboquant", bits=3.5, window=8, flush=8))
        mx.random.seed(seed)
        row.update_and_fetch(mx.random.normal((1, 2, 40, 64)), mx.random.normal((1, 2, 40, 64)))
        row.release_chunk()
        rows.append(row)
    assert rows[0].config == rows[1].config
    assert attrs.evolve(rows[0].config, budget=None) != make_config("turboquant", bits=4)
    assert packable(rows)


def test_eval_prints_each_layers_bits_grouped():
    from kvq.evaluation.report import _per_layer

    bits = [[4.0625, 2.9375]] * 4 + [[8.5, 8.5]] + [[4.0625, 2.9375]] * 2
    assert _per_layer(bits) == "layers 0-3, 5-6: 4.06 / 2.94; layer 4: 8.5 / 8.5"


def test_kvq_fit_and_generate_count_a_budget_as_stored():
    """kvq fit predicts a budget's bytes from the settings it buys (not the placeholder parameters), and kvq
    generate takes --bits 3.5."""
    from kvq.bench import fit
    from kvq.bench.random_model import random_config
    from kvq.cli.generate_cmd import _bits

    shape = fit.model_shape("random:tiny", random_config("random:tiny"), None, "float32")
    spec = parse_method("turboquant:3.5")
    cost = fit.cache_cost(spec, shape, 4, 128, None, "cpu")
    assert cost.bits_per_token == pytest.approx(2 * 3.5 * shape.head_dim)
    assert _bits("3.5") == 3.5 and _bits("4") == 4 and isinstance(_bits("4.0"), int)
