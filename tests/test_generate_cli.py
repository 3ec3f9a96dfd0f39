"""``kvq generate`` and ``kvq demo`` end to end; bad input gives one line on stderr and a non-zero exit."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from test_models import leftovers, write_tiny_gguf

from kvq import models, quality
from kvq.cli import main
from kvq.cli.demo_cmd import MAX_TOKENS, QUESTIONS, answer, demo_prompt, make_cache, question_ids
from kvq.cli.generate_cmd import prefill
from kvq.defaults import RECOMMENDED, THREE_BIT

# About 190 tokens: with a 16-token window most of them are compressed
PROMPT = demo_prompt('The "raise" statement', "What does raise do?")[:800]


@pytest.fixture(scope="session")
def default_folder() -> Path:
    """The default model's folder in the kvq cache of this machine ($KVQ_CACHE_DIR or platformdirs).

    Unlike test_models.py, which converts into a fresh cache to test the conversion, these tests reuse the cached
    conversion (made once per machine), as ``kvq demo`` does.
    """
    return models.default_model_path(progress=False)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty kvq cache for one test (for models converted from GGUF files written by the test)."""
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def row(text: str, label: str) -> list[str]:
    """The cells after ``label`` in the summary table (two or more spaces separate cells)."""
    line = next(line for line in text.splitlines() if line.startswith(label))
    return re.split(r"\s{2,}", line[len(label):].strip())


def one_line_error(capsys, command: str) -> str:
    """The single line that a failed command wrote to standard error."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvq {command}: error: "), captured.err
    return lines[0]


# End to end on the default model -------------------------------------------------------------------------------

@pytest.mark.slow
def test_generate_reports_speed_bytes_and_agreement(default_folder, capsys):
    argv = ["generate", "--model", str(default_folder), "--method", "turboquant", "--bits", "3", "--sinks", "4",
            "--window", "16", "--prompt", PROMPT, "--max-tokens", "6", "--compare", "kvcache"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "--- kvcache (float32) ---" in out and "--- turboquant bits=3 (window 16) ---" in out
    for label in ("prompt tokens/s", "generation tokens/s"):
        assert all(float(cell) > 0 for cell in row(out, label))
    # the reference: mlx-lm's KVCache; kvq's cache with its settings where they are not the defaults
    assert row(out, "cache") == ["kvcache (float32)", "turboquant bits=3 (window 16)"]
    assert row(out, "bits/coordinate (K / V)") == ["32 / 32", "3.25 / 3.25"]
    fp16_bytes, method_bytes = (float(cell.split()[0]) for cell in row(out, "KV bytes (nbytes)"))
    measured = [float(cell.split()[0]) for cell in row(out, "KV bytes (measured)")]
    assert method_bytes < fp16_bytes and measured[1] < measured[0]
    assert float(row(out, "compression vs kvcache (nbytes)")[1].rstrip("x")) > 2
    assert method_bytes == pytest.approx(measured[1], rel=0.1)  # nbytes is what is really resident
    agreed, total = map(int, row(out, "top-1 agreement (kvcache tokens)")[1].split("/"))
    assert total >= 1 and 0 <= agreed <= total
    assert float(row(out, "mean KL(kvcache || method)")[1].split()[0]) >= 0


@pytest.mark.slow
def test_generate_without_compare_measures_a_kvcache_of_the_same_length(default_folder, capsys):
    argv = ["generate", "--model", str(default_folder), "--key-method", "qjl", "--value-method", "affine",
            "--value-param", "bits=3", "--window", "16", "--prompt", PROMPT, "--max-tokens", "3", "--no-chat"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "K qjl" in out and "V affine bits=3" in out
    assert "kvcache bytes: of mlx-lm's KVCache holding this run's" in out and "agreement" not in out
    assert float(row(out, "compression vs kvcache (nbytes)")[1].rstrip("x")) > 2


@pytest.mark.slow
def test_demo_prints_answers_side_by_side_and_a_table(capsys):
    start = time.perf_counter()
    assert main(["demo"]) == 0
    seconds = time.perf_counter() - start
    out = capsys.readouterr().out
    labels = ["kvcache (float32)", RECOMMENDED, THREE_BIT]
    for i, question in enumerate(QUESTIONS):
        block = out.split(f"Q{i + 1}. {question}\n")[1].split("\n\n")[0].splitlines()
        assert [line.split()[0] for line in block] == [label.split()[0] for label in labels], block
    reference, recommended, three_bit = (row(out, label) for label in labels)
    nbytes, measured = map(float, re.findall(r"[\d.]+(?= MB)", reference[1]))
    assert reference[0] == "32" and measured == pytest.approx(nbytes, rel=0.02)  # float32: nbytes is resident
    assert reference[2:4] == ["1.00x", f"{len(QUESTIONS)}/{len(QUESTIONS)}"]
    assert recommended[0] == "4.25" and float(recommended[2].rstrip("x")) > 4
    assert three_bit[0] == "3.25" and float(three_bit[2].rstrip("x")) > float(recommended[2].rstrip("x"))
    assert f"{THREE_BIT} (3.25 bits per coordinate)." in out  # the opening line says what the 3-bit cache stores
    # the questions are those on which the recommended cache and the reference agree (demo_cmd.QUESTIONS)
    same, asked = map(int, recommended[3].split("/"))
    assert asked == len(QUESTIONS) and same >= asked - 1
    print(f"kvq demo took {seconds:.1f} s")  # shown with pytest -s; the target is under a minute on 2 CPU cores


@pytest.mark.slow
@pytest.mark.parametrize("method", [None, RECOMMENDED], ids=["kvcache", RECOMMENDED])
def test_demo_answers_from_a_reused_document_cache_as_from_a_fresh_prefill(default_folder, method):
    """The demo's structure: the document is prefilled once and each question answered from a copy. A question
    answered after another one was answered from the same prefilled cache gets the answer a fresh cache gives
    when the whole prompt is prefilled at once (mlx-lm's generate, its own prefill chunks), token for token."""
    model, tokenizer = models.load(default_folder, progress=False)
    document, suffixes = question_ids(tokenizer, QUESTIONS[:2])
    cache = make_cache(model, method)
    prefill(model, cache, document)
    offsets = [c.offset for c in cache]
    first = answer(model, tokenizer, cache, suffixes[0])
    reused = answer(model, tokenizer, cache, suffixes[1])
    assert [c.offset for c in cache] == offsets  # the answers grew copies, not the document's cache
    fresh = [r.token for r in mlx_lm.stream_generate(model, tokenizer, mx.array(document + suffixes[1]),
                                                      max_tokens=MAX_TOKENS, prompt_cache=make_cache(model, method))]
    assert first != reused and len(reused) > 5
    assert reused == fresh, (tokenizer.decode(reused), tokenizer.decode(fresh))


# A tiny random GGUF model: the whole pipeline, fast -------------------------------------------------------------

@pytest.fixture
def tiny_gguf(tmp_path):
    """A tiny random GGUF model file (see :func:`write_tiny_gguf`)."""
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source)
    return source


def test_generate_on_a_tiny_gguf_model(tiny_gguf, cache, capsys):
    argv = ["generate", "--model", str(tiny_gguf), "--method", "turboquant", "--bits", "2", "--sinks", "0",
            "--window", "0", "--flush", "1", "--prompt", "the the the the", "--max-tokens", "4", "--compare", "fp16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "prompt tokens/s" in out and "KV bytes (measured)" in out and "top-1 agreement" in out
    assert "nothing was compressed" not in out
    # no sinks, no window, flush 1: every token the cache holds is compressed, and the report says how many
    held = re.search(r"tokens in cache +(\d+) +(\d+) \((\d+) compressed\)", out)
    assert held and held.group(2) == held.group(3), out
    assert leftovers(cache) == []


def test_generate_samples_reproducibly_with_temp_and_seed(tiny_gguf, cache, capsys):
    texts = []
    for seed in (1, 1, 2):
        argv = ["generate", "--model", str(tiny_gguf), "--method", "turboquant:4", "--sinks", "0", "--window", "0",
                "--prompt", "the the the the", "--max-tokens", "12", "--temp", "5", "--seed", str(seed), "--no-chat"]
        assert main(argv) == 0
        out = capsys.readouterr().out
        texts.append(out.split("---\n", 1)[1].split("\n\n")[0])
    assert texts[0] == texts[1] and texts[0] != texts[2]


def test_generate_takes_eval_method_strings(tiny_gguf, cache, capsys):
    argv = ["generate", "--model", str(tiny_gguf), "--method", "turboquant:k4v3", "--sinks", "0", "--window", "0",
            "--prompt", "the the the the", "--max-tokens", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "--- K turboquant bits=4 / V turboquant bits=3 (sinks 0, window 0) ---" in out


def test_generate_names_kvqs_16_bit_cache_as_eval_does_and_sends_the_reference_to_compare():
    """``kvq eval`` writes kvq's 16-bit cache ``kvq-fp16`` (``fp16`` there is the reference's older name); generate
    takes that string too, as kvq's ``fp16`` method, and ``--method kvcache`` says where the reference goes."""
    from kvq.cache import make_config
    from kvq.cli.generate_cmd import build_parser, cache_options

    def options(*argv):
        return cache_options(build_parser().parse_args([*argv, "--prompt", "hi"]))

    for method in ("kvq-fp16", "fp16"):
        config = make_config(**options("--method", method, "--window", "16"))
        assert (config.key_params.method, config.value_params.method, config.window) == ("fp16", "fp16", 16)
    assert options("--method", "kvq-fp16[window=0]")["window"] == 0
    with pytest.raises(ValueError, match="--method kvcache is the reference.*--compare kvcache.*--method fp16"):
        options("--method", "kvcache")


def test_generate_says_when_nothing_was_compressed(tiny_gguf, cache, capsys):
    """A prompt and answer that fit in sinks + window compress nothing: the report must say so, since its bytes
    then differ only by allocation (a new user read 1.9x 'compression' and 0 KL as a lossless 4-bit cache)."""
    argv = ["generate", "--model", str(tiny_gguf), "--method", "turboquant", "--bits", "4", "--prompt", "the the",
            "--max-tokens", "3", "--compare", "fp16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "NOTE: nothing was compressed" in out and "sinks (4) and window (128, growing to 255" in out
    assert row(out, "compression vs kvcache (nbytes)")[1].endswith("x (none compressed)")  # the cell says it too


def test_generate_counts_the_tokens_a_flush_waits_for(tiny_gguf, cache, capsys):
    """No sinks and no window, but the default flush of 128: the few tokens of this run wait in the window for a
    whole block, so nothing is compressed and the report says so (it used to count only sinks + window)."""
    argv = ["generate", "--model", str(tiny_gguf), "--method", "turboquant:4", "--sinks", "0", "--window", "0",
            "--prompt", "the the", "--max-tokens", "3", "--compare", "fp16"]
    assert main(argv) == 0
    assert "NOTE: nothing was compressed" in capsys.readouterr().out


def test_the_note_names_the_flush_the_cache_runs(tiny_gguf, cache, capsys):
    """QJL compresses keys in groups of 32 tokens, so ``--flush 16`` flushes 32 (``CacheConfig.flush_tokens``): the
    NOTE must name the 32 the cache runs and the window's most tokens (16 + 32 - 1), not the option's 16."""
    argv = ["generate", "--model", str(tiny_gguf), "--method", "qjl+turboquant:4", "--window", "16", "--flush", "16",
            "--prompt", "the the", "--max-tokens", "3", "--compare", "fp16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "window (16, growing to 47 before a flush of 32)" in out
    assert "(window 16, flush 16 (runs 32)) ---" in out  # the header names both
    # and its advice: --flush 1 also runs 32 under QJL, so a prompt needs 32 tokens to compress any
    assert "--sinks 0 --window 0 --flush 1 with a prompt of at least 32 tokens (this cache compresses whole " \
           "blocks of 32)." in " ".join(out.split())


def test_teacher_forcing_replays_the_reference_and_leaves_the_cache_alone(tmp_path, cache):
    from kvq.cli.generate_cmd import REFERENCE, run_cache

    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source)
    model, tokenizer = models.load(source, progress=False)
    ids = tokenizer.encode("the the the the the")
    reference = run_cache(model, tokenizer, ids, REFERENCE, 6, record=True)
    again = run_cache(model, tokenizer, ids, REFERENCE, 6, reference=reference)
    assert reference.label == "kvcache (float32)"
    assert again.comparison.agreement == len(reference.tokens) == len(again.comparison)
    assert again.comparison.mean_kl == pytest.approx(0, abs=1e-6)  # the same cache, forced or free
    options = {"method": "turboquant", "bits": 2, "sinks": 0, "window": 0}
    free = run_cache(model, tokenizer, ids, options, 6)
    forced_first = run_cache(model, tokenizer, ids, options, 6, reference=reference)
    assert forced_first.label == free.label == "turboquant bits=2 (sinks 0, window 0)"
    assert forced_first.tokens == free.tokens and forced_first.nbytes == free.nbytes


# Bad input: one line on stderr, exit 1, nothing half-written ----------------------------------------------------

def test_unknown_model_path(cache, capsys):
    assert main(["generate", "--model", "/no/such/model", "--prompt", "hi"]) == 1
    assert "model '/no/such/model': no such file or folder" in one_line_error(capsys, "generate")


def test_gguf_of_unsupported_architecture(tmp_path, cache, capsys):
    source = tmp_path / "other.gguf"
    write_tiny_gguf(source, arch="gpt2")
    assert main(["generate", "--model", str(source), "--prompt", "hi"]) == 1
    assert "unsupported GGUF architecture 'gpt2'" in one_line_error(capsys, "generate")
    assert leftovers(cache) == [] and not any((cache / "models").glob("other-*"))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_gguf(tmp_path, cache, capsys, damage):
    whole = tmp_path / "whole.gguf"
    write_tiny_gguf(whole)
    data = whole.read_bytes()
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"GGUF" + bytes(range(256)) * 8)
    assert main(["generate", "--model", str(corrupt), "--prompt", "hi"]) == 1
    assert "corrupt.gguf" in one_line_error(capsys, "generate")
    assert leftovers(cache) == [] and not any((cache / "models").glob("corrupt-*"))


@pytest.mark.slow
def test_method_that_does_not_support_the_head_dim(default_folder, capsys):
    argv = ["generate", "--model", str(default_folder), "--method", "affine", "--param", "group_size=128",
            "--prompt", "hi", "--compare", "fp16"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before anything was generated
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "group_size=128" in lines[0] and "64" in lines[0], captured.err


@pytest.mark.parametrize("argv, message", [
    (["--method", "nope"], "method must be one of"),
    (["--method", "affine", "--param", "colour=red"], "unknown parameter(s) colour"),
    (["--method", "turboquant", "--bits", "9"], "bits"),
    (["--prompt-file", "/no/such/prompt.txt"], "cannot read --prompt-file /no/such/prompt.txt"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--window", "-5"], "--window must be an integer >= 0; got -5"),
    (["--method", "turboquant:3", "--sinks", "-1"], "--sinks must be an integer >= 0; got -1"),
    (["--flush", "0"], "--flush must be an integer >= 1; got 0"),
    (["--method", "turboquant:3", "--bits", "4"], "carries its own parameters: drop --bits"),
    (["--method", "turboquant:4[window=16,flush=16]", "--window", "64"],
     "sets window=16; got --window 64 as well: give each once"),
    (["--method", "affine", "--bits", "4", "--param", "bits=3"], "--bits 4 and --param bits=3 disagree"),
    (["--method", "mlx-affine:4"], "mlx-affine (mlx-lm's own cache) is for kvq eval"),
    (["--method", "qjl"], "qjl compresses keys only"),
    (["--temp", "-1"], "--temp must be >= 0"),
])
def test_bad_options_fail_before_loading_a_model(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    if "--prompt-file" not in argv:
        argv = [*argv, "--prompt", "hi"]
    assert main(["generate", *argv]) == 1
    assert message in one_line_error(capsys, "generate")


def test_exit_code_and_stderr_of_the_installed_script(cache):
    script = Path(sys.executable).parent / "kvq"
    result = subprocess.run([str(script), "generate", "--model", "missing.gguf", "--prompt", "hi"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().count("\n") == 0 and "model 'missing.gguf': no such file or folder" in result.stderr


# kvq.quality ----------------------------------------------------------------------------------------------------

def test_kl_divergence_and_agreement_helpers():
    p = np.log(np.array([[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]))
    q = np.log(np.array([[0.25, 0.5, 0.25], [1 / 3, 1 / 3, 1 / 3]]))
    np.testing.assert_allclose(quality.kl_divergence(p, q), [0.25 * np.log(2), 0.0], atol=1e-12)
    assert quality.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    comparison = quality.Comparison((0.1, 0.3), (True, False))
    assert comparison.mean_kl == pytest.approx(0.2) and comparison.agreement == 1 and len(comparison) == 2
    with pytest.raises(ValueError, match="cannot be compared"):
        quality.kl_divergence(p, q[:1])


def test_filled_cache_bytes_measures_the_cache_not_the_chunk_it_was_filled_with():
    """The stand-in fp16 cache `kvq generate --compare` sizes when the fp16 run stopped at another length: its
    measured bytes are the cache's own (they counted the float32 chunk the update keeps for attention, 3x nbytes:
    `kvq demo` reported an impossible 8.8x for a 3-bit cache)."""
    import mlx.core as mx

    from kvq import quality
    from kvq.bench import random_model

    model = random_model.build_random_model(random_model.random_config("tiny"), mx.float32)
    nbytes, measured = quality.filled_cache_bytes(model, 700, "fp16", sinks=4, window=128)
    assert nbytes > 0 and abs(measured - nbytes) <= 0.05 * nbytes
    nbytes3, measured3 = quality.filled_cache_bytes(model, 700, "turboquant", bits=3, sinks=4, window=128)
    assert nbytes3 < nbytes and abs(measured3 - nbytes3) <= 0.1 * nbytes3


def test_sizes_of_a_model_with_sliding_window_layers_count_its_full_layers():
    """Gemma 3's first layers keep a sliding window (16 tokens here): `kvq generate` counts the tokens the
    full-attention layer holds (it had reported layer 0's window, and sized the fp16 reference for that many tokens
    in every layer), and the reference filled with zeros holds what a real prefill and one decode token leave in
    mlx-lm's caches (filled in one update, the sliding layers had kept every token)."""
    from mlx_lm.models import cache as mlx_cache

    from kvq import quality
    from kvq.cache import make_prompt_cache
    from kvq.cli.generate_cmd import PREFILL_STEP, filled_reference_bytes, prefill, tokens_held
    from test_architectures import tiny

    model = tiny("gemma3_text")
    ids = [int(i) for i in mx.random.randint(0, 128, (PREFILL_STEP + 40,), key=mx.random.key(0))]
    real = mlx_cache.make_prompt_cache(model)
    prefill(model, real, ids[:-1])
    mx.eval(model(mx.array([ids[-1:]]), cache=real))
    assert [layer.size() for layer in real] == [16] * 5 + [len(ids)]
    assert tokens_held(real) == len(ids)
    assert filled_reference_bytes(model, len(ids))[0] == quality.cache_nbytes(real)
    ours = make_prompt_cache(model, "turboquant:4")
    prefill(model, ours, ids)
    assert tokens_held(ours) == len(ids)


def test_the_report_takes_its_sinks_and_window_from_a_full_attention_layer():
    """The summary's schedule (sinks, window, flush: the "nothing was compressed" note) is a full-attention layer's:
    gemma-3's layer 0 slides (mlx-lm's keep 0, a window capped by its size), which showed "--sinks 4" as 0."""
    from kvq.cache import KVQCache, RotatingKVQCache, make_config
    from kvq.cli.generate_cmd import _schedule

    config = make_config("turboquant", bits=4, sinks=4, window=16, flush=8)
    layers = [RotatingKVQCache(config, max_size=12, keep=0), KVQCache(config)]
    assert _schedule(layers) == (4, 16, 8)
    assert _schedule(layers[:1])[0] == 0  # only sliding layers: theirs
    assert _schedule([object()]) is None
