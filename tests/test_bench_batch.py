"""kvq bench batch with random:tiny on the CPU: every batch size, repetition and method through mlx-lm's
BatchGenerator, each sequence's tokens all generated, ratios against fp16 of the same repetition, the model left
unpatched, the files, and bad input caught before any model work."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from kvq.bench import batch, e2e, random_model
from kvq.cli import main

METHODS = ("kvcache", "affine:4", "turboquant:4")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One CLI run: random:tiny in float16, 1 and 3 prompts of 48 tokens, 6 new tokens each, two repetitions, no
    sinks and a 16-token window flushed every token (so decode compresses)."""
    out = tmp_path_factory.mktemp("batch")
    argv = ["bench", "batch", "--model", "random:tiny", "--batches", "1,3", "--prompt", "48", "--tokens", "6",
            "--reps", "2", "--chunk", "32", "--methods", ",".join(METHODS), "--dtype", "float16", "--sinks", "0",
            "--window", "16", "--flush", "1", "--out", str(out), "--name", "run", "--no-progress"]
    assert main(argv) == 0
    return out, json.loads((out / "run.json").read_text())


def test_every_batch_repetition_and_method_generates_every_token(run):
    _, doc = run
    rows = doc["rows"]
    assert [(r["batch"], r["rep"], r["method"]) for r in rows] == [
        (b, rep, m) for b in (1, 3) for rep in (0, 1) for m in METHODS]
    for r in rows:
        assert r["error"] is None
        assert r["tokens"] == 6 * r["batch"]
        assert r["decode_tokens_per_second"] == pytest.approx(5 * r["batch"] / r["decode_seconds"])
        assert r["prefill_seconds"] > 0 and r["peak_memory_growth"] > 0
        reference = next(x for x in rows if (x["batch"], x["rep"], x["method"]) == (r["batch"], r["rep"], "kvcache"))
        assert r["decode_vs_fp16"] == pytest.approx(r["decode_tokens_per_second"]
                                                    / reference["decode_tokens_per_second"])
        assert r["prefill_vs_fp16"] == pytest.approx(reference["prefill_seconds"] / r["prefill_seconds"])
    assert [r["cache"] for r in rows[:3]] == ["mlx-lm KVCache", "kvq BatchKVQCache", "kvq BatchKVQCache"]


def test_files_and_settings(run):
    out, doc = run
    assert (out / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "run.md").read_text()
    assert "### 3 sequences at once" in text and "Prompts: 48 random tokens each, 6 new tokens" in text
    assert doc["settings"]["batches"] == [1, 3] and doc["settings"]["methods"] == list(METHODS)
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
    settings = batch.BatchSettings((2,), prompt=24, tokens=3, reps=1, window=8, progress=False)
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


@pytest.mark.parametrize("args, message", [
    (["--methods", "fp16,mlx-affine:4"], "BatchGenerator cannot batch its QuantizedKVCache"),
    (["--tokens", "1"], "--tokens must be >= 2"),
    (["--prompt", "0"], "--prompt must be >= 1"),
    (["--batches", "2,0"], "--batches must be positive integers"),
    (["--prompt", "131072"], "exceed the model's max_position_embeddings (131072)"),
    (["--methods", "frobnicate:4"], "method must be one of"),
])
def test_bad_input_fails_before_model_work(no_model_work, tmp_path, capsys, args, message):
    assert main(["bench", "batch", "--model", "random:tiny", *args, "--out", str(tmp_path / "out")]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
