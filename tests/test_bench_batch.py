"""kvq bench batch with random:tiny on the CPU: every batch size, repetition and method through mlx-lm's
BatchGenerator, each sequence's tokens all generated, ratios against fp16 of the same repetition, warm-up
repetitions run but kept out of the rows and medians, each (batch, method)'s median and range over the timed ones,
step and host milliseconds per decode step, the model left unpatched, the files, and bad input caught before any
model work."""

from __future__ import annotations

import json
import importlib
import statistics

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
import pytest

from kvq.bench import batch, e2e, random_model
from kvq.bench.output import median_range
from kvq.cli import main

METHODS = ("kvcache", "affine:4", "turboquant:4")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One CLI run: random:tiny in float16, 1 and 3 prompts of 48 tokens, 6 new tokens each, one warm-up and three
    timed repetitions, no sinks and a 16-token window flushed every token (so decode compresses)."""
    out = tmp_path_factory.mktemp("batch")
    argv = ["bench", "batch", "--model", "random:tiny", "--batches", "1,3", "--prompt", "48", "--tokens", "6",
            "--warmup", "1", "--reps", "3", "--chunk", "32", "--methods", ",".join(METHODS), "--dtype", "float16",
            "--sinks", "0", "--window", "16", "--flush", "1", "--out", str(out), "--name", "run", "--no-progress"]
    assert main(argv) == 0
    return out, json.loads((out / "run.json").read_text())


def test_every_batch_repetition_and_method_generates_every_token(run):
    _, doc = run
    rows = doc["rows"]
    # the warm-up repetition is not among the rows: three timed ones per (batch, method)
    assert [(r["batch"], r["rep"], r["method"]) for r in rows] == [
        (b, rep, m) for b in (1, 3) for rep in (0, 1, 2) for m in METHODS]
    for r in rows:
        assert r["error"] is None
        assert r["tokens"] == 6 * r["batch"]
        assert r["decode_tokens_per_second"] == pytest.approx(5 * r["batch"] / r["decode_seconds"])
        # the first token of every sequence ends the prefill; 5 generator steps decode the other 5
        assert r["decode_steps"] == 5 and r["step_ms"] == pytest.approx(1e3 * r["decode_seconds"] / 5)
        host = r["host_ms"]["all"]
        assert len(host) == 5 and all(h > 0 for h in host) and r["host_ms"]["median"] == pytest.approx(
            statistics.median(host), abs=1e-3)  # "all" is rounded to 4 decimals
        build = r["build_ms"]["all"]  # the part before mx.async_eval is called
        assert len(build) == 5 and all(0 < b <= h + 1e-3 for b, h in zip(build, host))
        assert r["prefill_seconds"] > 0 and r["peak_memory_growth"] > 0
        reference = next(x for x in rows if (x["batch"], x["rep"], x["method"]) == (r["batch"], r["rep"], "kvcache"))
        assert r["decode_vs_fp16"] == pytest.approx(r["decode_tokens_per_second"]
                                                    / reference["decode_tokens_per_second"])
        assert r["prefill_vs_fp16"] == pytest.approx(reference["prefill_seconds"] / r["prefill_seconds"])
    assert [r["cache"] for r in rows[:3]] == ["mlx-lm KVCache", "kvq BatchKVQCache", "kvq BatchKVQCache"]


def test_cache_bytes_mid_decode_and_the_memory_bound_ceiling(run):
    """Every row notes its caches' allocated bytes after the middle decode step and the model's weight bytes; the
    ceiling is (weights + kvcache's cache bytes) / (weights + the row's), the same repetition's."""
    _, doc = run
    config = random_model.random_config("random:tiny")
    weights = sum(v.nbytes for _, v in tree_flatten(
        random_model.build_random_model(config, mx.float16).parameters()))
    # float16 keys and values of one token, every layer
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    for r in doc["rows"]:
        assert r["weights_bytes"] == weights
        reference = next(x for x in doc["rows"] if (x["batch"], x["rep"], x["method"]) == (r["batch"], r["rep"],
                                                                                            "kvcache"))
        assert r["ceiling_vs_fp16"] == pytest.approx((weights + reference["cache_bytes"])
                                                     / (weights + r["cache_bytes"]))
        if r["method"] == "kvcache":
            # mlx-lm's cache holds every token so far (48 of the prompt, 3 decoded at the middle step) in
            # steps of 256 tokens
            assert r["cache_bytes"] == r["batch"] * 256 * per_token and r["ceiling_vs_fp16"] == 1.0
        else:
            # 16 dense window tokens and 4-bit codes, with room to grow: more than the window alone, fewer than
            # kvcache's 256 tokens
            assert 16 * r["batch"] * per_token < r["cache_bytes"] < reference["cache_bytes"]
            assert r["ceiling_vs_fp16"] > 1.0 and r["cache_vs_fp16"] == pytest.approx(
                r["cache_bytes"] / reference["cache_bytes"])


def test_a_step_reads_the_embedding_table_only_where_it_is_the_output_projection():
    """weights_bytes: every parameter with tied embeddings (the table is the output projection); with an lm_head of
    its own, the input table (a step looks up one row per sequence) is left out."""
    tied = random_model.random_config("random:tiny")
    for tie in (True, False):
        model = random_model.build_random_model({**tied, "tie_word_embeddings": tie}, mx.float16)
        total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        table = model.model.embed_tokens.weight.nbytes
        assert table == tied["vocab_size"] * tied["hidden_size"] * 2
        assert batch.weights_bytes(model) == (total if tie else total - table)


def test_the_summary_is_the_median_and_range_of_the_timed_repetitions(run):
    out, doc = run
    summary = doc["summary"]
    assert [(s["batch"], s["method"]) for s in summary] == [(b, m) for b in (1, 3) for m in METHODS]
    text = (out / "run.md").read_text()
    for s in summary:
        same = [r for r in doc["rows"] if (r["batch"], r["method"]) == (s["batch"], s["method"])]
        assert s["reps"] == 3 and s["errors"] == [] and s["cache"] == same[0]["cache"]
        for key, value in (("prefill_seconds", lambda r: r["prefill_seconds"]),
                           ("decode_tokens_per_second", lambda r: r["decode_tokens_per_second"]),
                           ("decode_vs_fp16", lambda r: r["decode_vs_fp16"]), ("step_ms", lambda r: r["step_ms"]),
                           ("host_ms", lambda r: r["host_ms"]["median"]),
                           ("build_ms", lambda r: r["build_ms"]["median"]),
                           ("peak_memory_growth", lambda r: r["peak_memory_growth"])):
            values = [value(r) for r in same]
            assert s[key] == {"median": statistics.median(values), "min": min(values), "max": max(values),
                              "all": values}, key
        if s["method"] == "kvcache":
            assert s["decode_vs_fp16"]["all"] == [1.0, 1.0, 1.0]
        # the table's cells are these medians, with the range where the repetitions differ
        decode = median_range(s["decode_tokens_per_second"], ",.1f")
        assert f"{s['decode_tokens_per_second']['median']:,.1f} [" in decode
        assert f"| {s['method']} | {s['cache']} | 3 | {median_range(s['prefill_seconds'])} |" in text
        assert decode in text


def test_files_and_settings(run):
    out, doc = run
    assert (out / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "run.md").read_text()
    assert "### 3 sequences at once" in text and "Prompts: 48 random tokens each, 6 new tokens" in text
    assert "1 untimed warm-up and 3 timed repetitions" in text and "median over the timed repetitions" in text
    assert doc["settings"]["batches"] == [1, 3] and doc["settings"]["methods"] == list(METHODS)
    assert doc["settings"]["warmup"] == 1 and doc["settings"]["reps"] == 3
    assert doc["notes"] == []  # 48 + 6 tokens pass the 16-token window: decode compresses


def test_a_run_that_compresses_nothing_says_so():
    settings = batch.BatchSettings((1,), prompt=64, tokens=4)  # 4 sinks + 128-token window: nothing leaves it
    (note,) = batch.notes(settings)
    assert "nothing is compressed" in note and "--prompt" in note
    assert batch.notes(batch.BatchSettings((1,), prompt=200, tokens=4, flush=32)) == []  # 4 + 128 + 31 < 204
    assert batch.notes(batch.BatchSettings((1,), prompt=300, tokens=4)) == []  # the default flush, 128


def test_kvq_rows_patch_the_model_only_while_they_run():
    """A kvq row's BatchGenerator makes kvq caches (the model patched); afterwards the model makes mlx-lm's
    caches again, so the next repetition's fp16 row measures mlx-lm, and a failing row unpatches it too."""
    from mlx_lm.models.cache import KVCache

    model = random_model.build_random_model(random_model.random_config("random:tiny"), mx.float32)
    settings = batch.BatchSettings((2,), prompt=24, tokens=3, reps=1, warmup=0, window=8, progress=False)
    seen = []
    original = batch.generate

    def spy(model_, prompts_, tokens, chunk):
        seen.append(type(model_.make_cache()[0]).__name__)
        return original(model_, prompts_, tokens, chunk)

    specs = e2e.parse_methods("fp16,affine:4")
    try:
        batch.generate = spy
        rows = batch.BatchBench(model, settings, 32).run(specs)
    finally:
        batch.generate = original
    assert seen == ["KVCache", "KVQCache"] and all(r["error"] is None for r in rows)
    assert type(model.make_cache()[0]) is KVCache and not hasattr(model, "_kvq_original_make_cache")

    def fail(*args):
        raise RuntimeError("out of memory")

    try:
        batch.generate = fail
        rows = batch.BatchBench(model, settings, 32).run(specs)
    finally:
        batch.generate = original
    assert [r["error"] for r in rows] == ["RuntimeError: out of memory"] * 2
    assert type(model.make_cache()[0]) is KVCache


def test_warm_up_repetitions_run_first_and_stay_out_of_the_rows(monkeypatch):
    """Every batch size runs --warmup repetitions of every method before its timed ones; only the timed ones become
    rows (and reach on_row), numbered from 0, and the summary's medians are theirs."""
    calls = []

    def fake(model, prompts_, tokens, chunk):
        calls.append(len(prompts_))
        n = len(calls)  # the warm-up calls' values (the smallest) must not reach any median
        return {"prefill_seconds": float(n), "decode_seconds": 1.0, "decode_steps": tokens - 1, "tokens": 0,
                "decode_tokens_per_second": 10.0 * n, "step_ms": float(n), "host_ms": {"median": n / 10},
                "peak_memory_growth": 100}

    monkeypatch.setattr(batch, "generate", fake)
    settings = batch.BatchSettings((1, 2), prompt=4, tokens=3, reps=3, warmup=2, progress=False)
    seen = []
    rows = batch.BatchBench(nn.Module(), settings, 32).run(e2e.parse_methods("kvcache"), on_row=seen.append)
    assert calls == [1] * 5 + [2] * 5 and rows == seen
    assert [(r["batch"], r["rep"]) for r in rows] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    one, two = batch.summarize(rows)
    assert one["prefill_seconds"] == {"median": 4.0, "min": 3.0, "max": 5.0, "all": [3.0, 4.0, 5.0]}
    assert two["decode_tokens_per_second"]["all"] == [80.0, 90.0, 100.0] and two["step_ms"]["median"] == 9.0
    assert two["host_ms"]["median"] == pytest.approx(0.9) and two["decode_vs_fp16"]["all"] == [1.0, 1.0, 1.0]


def test_a_failed_repetition_is_counted_and_left_out_of_the_medians():
    ok = {"batch": 1, "method": "affine:4", "cache": "kvq BatchKVQCache", "error": None, "prefill_seconds": 2.0}
    rows = [ok, {**ok, "error": "RuntimeError: out of memory"}, {**ok, "prefill_seconds": 4.0}]
    (s,) = batch.summarize(rows)
    assert s["reps"] == 3 and s["errors"] == ["RuntimeError: out of memory"]
    assert s["prefill_seconds"] == {"median": 3.0, "min": 2.0, "max": 4.0, "all": [2.0, 4.0]}
    assert s["decode_tokens_per_second"]["median"] is None  # absent from every row


def test_the_step_clock_stands_in_for_mlx_lm_generate_s_mx_only_while_it_runs():
    """Host time per step is timed from mlx_lm.generate's own mx.eval to its next mx.async_eval; the stand-in
    is put back even when the generator fails."""
    module = importlib.import_module("mlx_lm.generate")
    with pytest.raises(RuntimeError, match="boom"):
        with batch.clocked() as clock:
            assert module.mx is clock and clock.array is mx.array
            x = mx.ones(3)
            clock.async_eval(x)  # no step's tokens have reached Python yet: nothing to time
            clock.eval(x)
            clock.async_eval(x + 1)
            clock.async_eval(x + 2)  # a second queueing after one eval is not another step
            assert len(clock.host) == 1 and clock.host[0] > 0
            raise RuntimeError("boom")
    assert module.mx is mx


@pytest.mark.parametrize("args, message", [
    (["--warmup", "-1"], "--warmup must be >= 0; got -1"),
    (["--reps", "0"], "--reps must be >= 1; got 0"),
    (["--methods", "fp16,mlx-affine:4"], "BatchGenerator cannot batch its QuantizedKVCache"),
    (["--tokens", "1"], "--tokens must be >= 2"),
    (["--prompt", "0"], "--prompt must be >= 1"),
    (["--batches", "2,0"], "--batches must be positive integers"),
    (["--prompt", "131072"], "exceed the model's max_position_embeddings (131072)"),
    (["--methods", "frobnicate:4"], "method must be one of"),
    (["--prompt", "64", "--shortest", "65"], "--shortest must be from 1 to --prompt (64); got 65"),
    (["--shortest", "0"], "--shortest must be from 1 to --prompt"),
])
def test_bad_input_fails_before_model_work(no_model_work, tmp_path, capsys, args, message):
    assert main(["bench", "batch", "--model", "random:tiny", *args, "--out", str(tmp_path / "out")]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_results_file_says_how_long_the_prompts_were():
    from kvq.bench.batch_report import prompt_lengths

    assert prompt_lengths({"prompt": 2048}) == prompt_lengths({"prompt": 2048, "shortest": None}) == "2048"
    assert prompt_lengths({"prompt": 2048, "shortest": 256}) == "2048 down to 256 (evenly spaced)"


def test_prompts_of_different_lengths_are_spread_from_prompt_down_to_shortest():
    """``--shortest``: a batch's prompts evenly spaced from ``--prompt`` down to it (a server's requests differ),
    each a prefix of the equal-length run's prompt; one sequence, or no --shortest, keeps ``--prompt`` tokens."""
    equal = batch.prompts(5, 100, 50, 0)
    spread = batch.prompts(5, 100, 50, 0, shortest=20)
    assert [len(p) for p in spread] == [100, 80, 60, 40, 20] and {len(p) for p in equal} == {100}
    assert all(p == q[:len(p)] for p, q in zip(spread, equal))
    assert [len(p) for p in batch.prompts(1, 100, 50, 0, shortest=20)] == [100]
