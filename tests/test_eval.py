"""kvq eval: method strings, input errors before any model work, mlx-affine's CPU path, and one small real run."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from conftest import config_folder

from kvq.cli import main
from kvq.evaluation import parse_method, parse_methods
from kvq.evaluation.needle import is_match
from kvq.evaluation.perplexity import window_offsets
from kvq.evaluation.spec import bits_per_coordinate, split_methods

# -- method strings ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, keys, values, cache", [
    ("kvcache", ("kvcache", {}), ("kvcache", {}), {}),
    ("kvq-fp16", ("fp16", {}), ("fp16", {}), {}),
    ("kvq-fp16[window=0]", ("fp16", {}), ("fp16", {}), {"window": 0}),
    ("affine:4+fp16", ("affine", {"bits": 4}), ("fp16", {}), {}),
    ("affine:4", ("affine", {"bits": 4}), ("affine", {"bits": 4}), {}),
    ("affine:k8v4", ("affine", {"bits": 8}), ("affine", {"bits": 4}), {}),
    ("qjl+affine:2", ("qjl", {}), ("affine", {"bits": 2}), {}),
    ("turboquant:3[rotation=qr]", ("turboquant", {"bits": 3, "rotation": "qr"}),
     ("turboquant", {"bits": 3, "rotation": "qr"}), {}),
    ("qjl[sketch_dim=128,outlier_channels=0]+affine:4", ("qjl", {"sketch_dim": 128, "outlier_channels": 0}),
     ("affine", {"bits": 4}), {}),
    ("affine:8[sinks=0,window=0,flush=1]", ("affine", {"bits": 8}), ("affine", {"bits": 8}),
     {"sinks": 0, "window": 0, "flush": 1}),
    ("mlx-affine:4[group_size=32]", ("mlx-affine", {"bits": 4, "group_size": 32}),
     ("mlx-affine", {"bits": 4, "group_size": 32}), {}),
])
def test_method_strings_parse(text, keys, values, cache):
    spec = parse_method(text)
    assert spec.label == text
    assert (spec.key_method, spec.key_params) == keys
    assert (spec.value_method, spec.value_params) == values
    assert spec.cache_options == cache


def test_methods_split_outside_brackets_and_the_reference_comes_first():
    assert split_methods("affine:4,qjl[sketch_dim=64,seed=1]+affine:4,fp16") == [
        "affine:4", "qjl[sketch_dim=64,seed=1]+affine:4", "fp16"]
    assert [s.label for s in parse_methods("affine:4,kvcache")] == ["kvcache", "affine:4"]
    assert [s.label for s in parse_methods("turboquant:3")] == ["kvcache", "turboquant:3"]


def test_fp16_alone_is_the_reference_by_its_older_name():
    """Issue #54: ``fp16`` meant mlx-lm's KVCache in kvq bench and kvq's 16-bit cache in kvq eval; it is now the
    reference, mlx-lm's KVCache, everywhere (accepted as before), and ``kvq-fp16`` is kvq's 16-bit cache."""
    assert parse_method("fp16") == parse_method("kvcache") and parse_method("fp16").is_reference
    assert [s.label for s in parse_methods("affine:4,fp16")] == ["kvcache", "affine:4"]
    # the message says why: the two names are one cache
    with pytest.raises(ValueError, match=r"kvcache given more than once \(fp16 also names kvcache, mlx-lm's own "
                                         r"cache; kvq's 16-bit cache is kvq-fp16\)"):
        parse_methods("fp16,kvcache")
    with pytest.raises(ValueError, match=r"^--methods: affine:4 given more than once$"):
        parse_methods("affine:4,affine:4")
    assert not parse_method("kvq-fp16").is_reference


def test_bits_per_coordinate_of_specs():
    assert bits_per_coordinate(parse_method("mlx-affine:4"), 64) == (4.5, 4.5)
    assert bits_per_coordinate(parse_method("affine:k8v4"), 64) == (8.5, 4.5)
    assert bits_per_coordinate(parse_method("kvq-fp16"), 64) == (16, 16)
    assert bits_per_coordinate(parse_method("kvcache"), 64, mx.float32) == (32, 32)
    assert bits_per_coordinate(parse_method("kvcache"), 64, mx.bfloat16) == (16, 16)


@pytest.mark.parametrize("text, message", [
    ("", "empty method"),
    ("affine:4,,fp16", "empty method"),
    ("affine:x", "must be an integer"),
    ("affine:4:5", "must be an integer"),
    ("affine[bits]", "NAME=VALUE"),
    ("affine:4[bits=3]", "bits given twice"),
    ("affine[bits=4", "unclosed"),
    ("qjl+affine+fp16", "at most one '+'"),
    ("qjl+affine:k8v4", "kNvM bits are for one method"),
    ("4bit", "cannot parse"),
    ("nope:4", "method must be one of"),
    ("affine:7", "bits"),
    ("qjl:4", "unknown parameter(s) bits"),
    ("affine:4[sinks=-1]", "sinks must be"),
    ("mlx-affine:7", "needs bits in"),
    ("mlx-affine:4[window=0]", "has no sinks or window"),
    ("mlx-affine+affine:4", "cannot be combined"),
    ("affine:4,affine:4", "more than once"),
])
def test_bad_method_strings_are_named(text, message):
    with pytest.raises(ValueError, match=None) as info:
        parse_methods(text)
    assert message in str(info.value)


def test_head_dim_is_checked_when_known():
    with pytest.raises(ValueError, match="head_dim 48 .* group sizes 32, 64, 128 only"):
        parse_methods("affine:4", head_dim=48)
    with pytest.raises(ValueError, match="group_size=64 must divide"):
        parse_methods("affine:4[group_size=64]", head_dim=96)
    with pytest.raises(ValueError, match="does not divide head_dim"):
        parse_methods("mlx-affine:4", head_dim=48)


# -- the command line: bad input fails before any model work ----------------------------------------------


@pytest.fixture
def no_model_work(monkeypatch):
    """Loading a model (or running an evaluation) fails the test."""
    import kvq.evaluation.harness
    import kvq.models

    def refuse(*args, **kwargs):
        raise AssertionError("model work started before the input was checked")

    monkeypatch.setattr(kvq.models, "load", refuse)
    monkeypatch.setattr(kvq.evaluation.harness.Evaluation, "__init__", refuse)


@pytest.fixture
def small_model_folder(tmp_path):
    """A model folder whose config says max_position_embeddings 1024 (no weights: nothing may load it)."""
    return config_folder(tmp_path / "model")


@pytest.mark.parametrize("args, message", [
    (["--methods", "affine:x"], "must be an integer"),
    (["--methods", "frobnicate:4"], "method must be one of"),
    (["--methods", "fp16", "--context", "2048,abc"], "--context must be positive integers"),
    (["--methods", "fp16", "--needle-depths", "0.5,2"], "--needle-depths"),
    (["--methods", "fp16", "--windows", "0"], "--windows must be >= 1"),
    (["--methods", "affine:4", "--flush", "0"], "--flush must be an integer >= 1; got 0"),
])
def test_bad_arguments_fail_before_model_work(no_model_work, small_model_folder, capsys, args, message):
    assert main(["eval", "--model", str(small_model_folder), *args]) == 1
    assert message in capsys.readouterr().err


def test_flush_applies_to_kvq_caches_unless_a_method_string_sets_its_own(no_model_work, small_model_folder):
    from kvq.cli import eval_cmd

    args = eval_cmd.parser().parse_args(["--model", str(small_model_folder), "--methods",
                                         "affine:4,turboquant:3[flush=2],mlx-affine:4", "--flush", "8",
                                         "--context", "512"])
    specs = {spec.label: spec for spec in eval_cmd.check(args)[0]}
    assert specs["affine:4"].cache_kwargs(4, 128)["flush"] == 8
    assert specs["turboquant:3[flush=2]"].cache_kwargs(4, 128)["flush"] == 2
    assert "flush" not in specs["mlx-affine:4"].cache_options  # mlx-lm's cache has no window


def test_context_longer_than_the_model_allows(no_model_work, small_model_folder, capsys):
    assert main(["eval", "--model", str(small_model_folder), "--methods", "fp16,affine:4",
                 "--context", "512,2K"]) == 1  # K suffixes as in kvq bench
    assert "--context 2048 is longer than the model's max_position_embeddings (1024)" in capsys.readouterr().err


def test_empty_text_and_unreadable_text(no_model_work, small_model_folder, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    assert main(["eval", "--model", str(small_model_folder), "--methods", "fp16", "--text", str(empty)]) == 1
    assert "is empty" in capsys.readouterr().err
    assert main(["eval", "--model", str(small_model_folder), "--methods", "fp16", "--text",
                 str(tmp_path / "missing.txt")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_head_dim_checked_from_the_model_config(no_model_work, small_model_folder, capsys):
    assert main(["eval", "--model", str(small_model_folder), "--methods", "mlx-affine:4[group_size=128]",
                 "--context", "512"]) == 1
    assert "does not divide head_dim 64" in capsys.readouterr().err


def test_help_documents_the_grammar(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = capsys.readouterr().out
    assert "affine:k8v4" in text and "qjl+affine:2" in text and "mlx-affine" in text


# -- pieces -----------------------------------------------------------------------------------------------


def test_window_offsets_are_fixed_and_fit():
    assert window_offsets(10_000, 1_000, 3) == [2250, 4500, 6750]
    with pytest.raises(ValueError, match="the text has 500 tokens"):
        window_offsets(500, 1_000, 3)


def test_needle_match_takes_the_first_number():
    assert is_match("The secret code is 4817.", "4817")
    assert not is_match("The secret code is 481", "4817")
    assert not is_match("It is 2093, not 4817", "4817")
    assert not is_match("I don't know.", "4817")


def test_dequantized_attention_equals_mlx_lm_quantized_attention():
    """The CPU path of mlx-affine computes the same products as mlx-lm's quantized_matmul path."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention
    from mlx_lm.models.cache import QuantizedKVCache

    from kvq.evaluation.attention_error import dequantized_attention

    cache = QuantizedKVCache(group_size=64, bits=4)
    keys, values = mx.random.normal((1, 3, 300, 64)), mx.random.normal((1, 3, 300, 64))
    k, v = cache.update_and_fetch(keys, values)
    queries = mx.random.normal((1, 9, 20, 64))
    # mlx-lm scales its queries argument in place (queries *= scale): give it its own array
    expected = quantized_scaled_dot_product_attention(mx.array(queries), k, v, scale=0.125, mask="causal",
                                                      group_size=64, bits=4)
    got = dequantized_attention(queries, k, v, cache, 0.125, "causal")
    assert (mx.abs(got - expected).max() / mx.abs(expected).max()).item() < 1e-5


# -- one small real run on the default model --------------------------------------------------------------


@pytest.mark.slow
def test_small_evaluation_on_the_default_model(tmp_path, capsys):
    """512 tokens of context, 64 scored, 1 window: the reference (mlx-lm's KVCache, float32), kvq affine 8-bit (no sinks/window, every token compressed
    as it arrives: flush 1), mlx-lm's own.

    Why kvq affine:8 and mlx-affine:8 agree to 1e-2 here, not 1e-3: quantization is discontinuous, so float-order
    differences of ~1e-7 in the first layers' attention (kvq's blockwise softmax vs mx.fast) flip codes at rounding
    boundaries, and the flips compound over 30 layers: even with kvq quantizing exactly as mlx-lm (float32 scales)
    the two runs' PPL differ by 0.26% on these 64 tokens, while their per-layer attention errors on the same keys
    and values are identical. kvq stores float16 scales and casts float32 keys to float16 first (5% of 8-bit
    codes differ from mlx-lm's); that changes the per-layer attention error by about 1.5%.
    """
    out = tmp_path / "eval.json"
    args = ["eval", "--methods", "fp16,affine:8[sinks=0,window=0,flush=1],mlx-affine:8", "--context", "512",
            "--score-tokens", "64", "--windows", "1", "--needle-depths", "none", "--no-progress",
            "--json", str(out), "--plot", str(tmp_path / "eval.png"), "--markdown", str(tmp_path / "eval.md")]
    assert main(args) == 0
    assert "| kvcache | 32 (32) |" in capsys.readouterr().out
    rows = {r["method"]: r for r in json.loads(out.read_text())["runs"][0]["rows"]}
    assert rows["kvcache"]["cache"] == "mlx-lm KVCache"
    fp16, kvq8, mlx8 = rows["kvcache"], rows["affine:8[sinks=0,window=0,flush=1]"], rows["mlx-affine:8"]
    assert fp16["ppl_change"] == 0.0 and fp16["kl"] == 0.0 and fp16["top1_agreement"] == 1.0
    assert 1 < fp16["ppl"] < 100
    assert kvq8["kl"] < 0.01 and mlx8["kl"] < 0.01
    assert abs(kvq8["ppl"] / mlx8["ppl"] - 1) < 1e-2
    assert abs(kvq8["attention_error"]["mean"] / mlx8["attention_error"]["mean"] - 1) < 0.05
    assert kvq8["bits_per_coordinate"] == mlx8["bits_per_coordinate"] == 8.5
    assert 0.2 < kvq8["kv_bytes_ratio"] < 0.35 and 0.2 < kvq8["memory_ratio"] < 0.35  # 8.5 bits of 32
    assert (tmp_path / "eval.png").stat().st_size > 10_000 and "mlx-affine:8" in (tmp_path / "eval.md").read_text()


def test_layer_cache_binds_per_layer_parameters():
    """The attention-error replay builds one layer's cache with that layer's parameters (VecInfer's codebooks are
    per layer), as kvq.make_prompt_cache does; other methods are unaffected."""
    from kvq.evaluation.spec import make_layer_cache, parse_method

    cache = make_layer_cache(parse_method("vecinfer[model_id=some-model]"), 4, 128, layer=3)
    assert cache.config.key_params.layer == 3 and cache.config.value_params.layer == 3
    plain = make_layer_cache(parse_method("turboquant:4"), 4, 128, layer=3)
    assert plain.config.key_params.bits == 4 and plain.config.key_params.method == "turboquant"


def test_long_reference_text_is_encoded_without_transformers_length_warning():
    """``kvq eval``/``kvq bench`` tokenize a reference text far longer than the model's context on purpose:
    ``encode_text`` gives the same ids as the tokenizer, without transformers' "sequence length is longer than
    the specified maximum" warning (it read as an error to a new user), and leaves transformers' verbosity as
    it was."""
    import logging as std_logging

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging

    from kvq.textdata import encode_text

    words = ["alpha", "beta", "gamma", "[UNK]"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, model_max_length=8, unk_token="[UNK]")
    text = " ".join(["alpha beta gamma"] * 10)  # 30 tokens > 8

    class Collect(std_logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    handler = Collect()
    logging.get_logger("transformers").addHandler(handler)
    before = logging.get_verbosity()
    try:
        ids = encode_text(tokenizer, text)
        assert ids == [0, 1, 2] * 10 and logging.get_verbosity() == before
        # kvq calibrate's form: the tokenizer's own special tokens kept, as tokenizer.encode(text) gives them
        assert encode_text(tokenizer, text, special_tokens=True) == tokenizer.encode(text)
        assert not [m for m in handler.messages if "longer than the specified maximum" in m]
        # the warning it silences, from a fresh tokenizer (each warns once)
        fresh = PreTrainedTokenizerFast(tokenizer_object=core, model_max_length=8, unk_token="[UNK]")
        fresh.encode(text, add_special_tokens=False)
        assert [m for m in handler.messages if "longer than the specified maximum" in m]
    finally:
        logging.get_logger("transformers").removeHandler(handler)


# -- BOS at the start of each window ----------------------------------------------------------------------


def word_tokenizer(bos: bool):
    """mlx-lm's wrapper of a word-level Hugging Face tokenizer over "w0".."w199"; with ``bos``, its post-processor
    puts "<s>" (id 200) in front of every text, as Gemma's does (and its ``add_bos_token`` attribute says False)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(200)} | {"<s>": 200, "</s>": 201, "<unk>": 202}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 200)])
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                                    unk_token="<unk>"))


@pytest.mark.parametrize("bos", [True, False])
def test_windows_and_needles_start_with_bos_where_the_tokenizer_adds_one(bos):
    """Each window is [BOS] + the text from its offset, one text token fewer, so its length stays
    context + scored + 1 and the BOS is prefilled, never a scored target; needle prompts start with it too and keep
    ``context`` tokens. A tokenizer that adds no BOS (SmolLM2's, Qwen2's) leaves windows as they were."""
    from conftest import tiny_llama

    from kvq.evaluation import EvalSettings, Evaluation
    from kvq.textdata import bos_ids

    tokenizer = word_tokenizer(bos)
    assert bos_ids(tokenizer) == ([200] if bos else [])
    text_ids = [i % 200 for i in range(3000)]
    settings = EvalSettings(64, windows=2, score_tokens=16, needle_depths=(0.5,), progress=False)
    evaluation = Evaluation(tiny_llama(vocab=203, dtype=mx.float32), tokenizer, text_ids, settings)
    for offset, window in zip(evaluation.offsets, evaluation.windows):
        ids = window.tolist()
        assert len(ids) == 64 + 16 + 1
        if bos:
            assert ids == [200] + text_ids[offset : offset + 80] and 200 not in ids[65:]  # scored targets
        else:
            assert ids == text_ids[offset : offset + 81]
    (needle,) = evaluation.needles
    assert len(needle) == 64 and (needle[0] == 200) == bos and needle.count(200) == int(bos)
    row = evaluation.run([parse_method("fp16")])[0]
    assert row["ppl_change"] == 0.0 and 1 < row["ppl"]
