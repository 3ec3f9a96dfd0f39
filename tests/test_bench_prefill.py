"""kvq bench prefill with random:tiny (on the CPU in CI; the H200 ran it too): every row measured against fp16 of
its repetition, bytes that a compressed cache really saves, the files, failed rows recorded, and bad input caught
before any model work."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from kvq.bench import prefill
from kvq.cli import main
from kvq.problem import device_kind

METHODS = ("kvcache", "affine:4", "turboquant:3")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One CLI run: random:tiny in float16, prompts of 128 and 256 tokens in chunks of 64, two repetitions."""
    out = tmp_path_factory.mktemp("prefill")
    argv = ["bench", "prefill", "--model", "random:tiny", "--contexts", "128,256", "--chunk", "64", "--reps", "2",
            "--methods", ",".join(METHODS), "--dtype", "float16", "--window", "16", "--flush", "1", "--out", str(out),
            "--name", "run", "--no-progress"]
    assert main(argv) == 0
    return out, json.loads((out / "run.json").read_text())


def test_every_context_repetition_and_method_has_a_measured_row(run):
    _, doc = run
    rows = doc["rows"]
    assert [(r["context"], r["rep"], r["method"]) for r in rows] == [
        (c, rep, m) for c in (128, 256) for rep in (0, 1) for m in METHODS]
    for r in rows:
        assert r["error"] is None
        assert r["tokens_per_second"] == pytest.approx(r["context"] / r["seconds"])
        # the wall time's split: the model's calls and each chunk's evaluation, within the loop's own overhead
        parts = r["forward_seconds"] + r["eval_seconds"]
        assert 0 < parts <= r["seconds"] and parts >= 0.8 * r["seconds"] - 2e-3
        assert 0 <= r["queue_wait_seconds"] <= r["forward_seconds"]
        if r["method"] == "kvcache" or device_kind() == "cpu":  # kvq's layer queue: a GPU's chunks only
            assert r["queue_wait_seconds"] == 0
        assert r["peak_memory_growth"] >= r["kv_bytes"] > 0  # the caches exist at the end of the prefill
        reference = next(x for x in rows if (x["context"], x["rep"], x["method"]) == (r["context"], r["rep"], "kvcache"))
        assert r["speed_vs_fp16"] == pytest.approx(r["tokens_per_second"] / reference["tokens_per_second"])
        assert r["peak_vs_fp16"] == pytest.approx(r["peak_memory_growth"] / reference["peak_memory_growth"])
    assert [r["cache"] for r in rows[:3]] == ["mlx-lm KVCache", "kvq KVQCache", "kvq KVQCache"]


def test_compressed_caches_hold_fewer_bytes(run):
    """At 256 tokens (fp16's KVCache preallocates 256 too): 4 sinks and a 16-token window in 16 bits, the rest in
    the method's bits, the compressed store preallocated in steps of 256 tokens."""
    _, doc = run
    by = {(r["context"], r["rep"], r["method"]): r for r in doc["rows"]}
    fp16 = by[256, 1, "kvcache"]["kv_bytes"]
    assert fp16 == 2 * 2 * 2 * 256 * 64 * 2  # tiny: 2 layers x (K, V) x 2 heads x 256 tokens x 64 dims x 2 bytes
    for method, bits in (("affine:4", 4.5), ("turboquant:3", 3.25)):
        ratio = by[256, 1, method]["kv_bytes_ratio"]
        assert bits / 16 < ratio < bits / 16 + 0.2, method  # codes of 256 tokens + the 16-bit sinks and window


def test_files_and_environment(run):
    out, doc = run
    assert (out / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "run.md").read_text()
    assert "### 256 tokens of prompt" in text and "| affine:4 | kvq KVQCache | 2 |" in text
    env = doc["environment"]
    assert env["command"].startswith("kvq bench prefill --model random:tiny --contexts 128,256")
    assert env["device_kind"] == device_kind() and env["mlx"] == mx.__version__
    assert doc["settings"]["chunk"] == 64 and doc["settings"]["reps"] == 2 and doc["settings"]["flush"] == 1
    assert doc["settings"]["prompt"] == "random token ids" and doc["model"]["layers"] == 2


def test_a_failing_method_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    real = prefill.make_cache

    def fail_affine(model, spec, settings):
        if spec.label == "affine:4":
            raise RuntimeError("no memory left")
        return real(model, spec, settings)

    monkeypatch.setattr(prefill, "make_cache", fail_affine)
    argv = ["bench", "prefill", "--model", "random:tiny", "--contexts", "64", "--chunk", "32", "--reps", "1",
            "--methods", "fp16,affine:4,turboquant:4", "--out", str(tmp_path), "--name", "r", "--no-progress",
            "--no-plot"]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["error"] for r in rows] == [None, "RuntimeError: no memory left", None]
    assert rows[1]["speed_vs_fp16"] is None and rows[2]["speed_vs_fp16"] > 0
    assert "error: RuntimeError: no memory left" in (tmp_path / "r.md").read_text()


def test_real_text_prompts_repeat_the_text():
    ids = prefill.prompt(7, 100, [5, 6, 7], seed=0)
    assert ids.tolist() == [5, 6, 7, 5, 6, 7, 5]
    a, b = prefill.prompt(64, 100, None, seed=1), prefill.prompt(64, 100, None, seed=1)
    assert a.tolist() == b.tolist() and 0 <= min(a.tolist()) and max(a.tolist()) < 100


@pytest.mark.parametrize("args, message", [
    (["--reps", "0"], "--reps must be >= 1; got 0"),
    (["--chunk", "0"], "--chunk must be >= 1; got 0"),
    (["--flush", "0"], "--flush must be >= 1; got 0"),
    (["--contexts", "256K"], "longer than the model's max_position_embeddings (131072)"),
    (["--methods", "frobnicate:4"], "method must be one of"),
    (["--layers", "3"], "--layers must be in 1..2"),
])
def test_bad_input_fails_before_model_work(no_model_work, tmp_path, capsys, args, message):
    assert main(["bench", "prefill", "--model", "random:tiny", *args, "--out", str(tmp_path / "out")]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_prefill_is_a_bench_subcommand(capsys):
    assert main(["bench", "--help"]) == 0
    assert "prefill" in capsys.readouterr().out
