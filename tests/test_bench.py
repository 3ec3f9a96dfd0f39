"""kvq bench e2e on the CPU with random:tiny: every row, bytes that match the bits accounting, the files, failed
rows recorded, fills that store what they are given, and bad input caught before any model work."""

from __future__ import annotations

import gc
import json

import attrs
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kvq.bench import e2e, fill, random_model
from kvq.cli import main

METHODS = ("kvcache", "affine:4", "turboquant:4")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One CLI run: random:tiny in float16, contexts 64 and 128, no sinks or window and a flush of 32 (every token
    of both contexts compressed)."""
    out = tmp_path_factory.mktemp("e2e")
    argv = ["bench", "e2e", "--model", "random:tiny", "--contexts", "64,128", "--methods", ",".join(METHODS),
            "--steps", "2", "--dtype", "float16", "--sinks", "0", "--window", "0", "--flush", "32", "--out", str(out),
            "--name", "run", "--no-progress"]
    assert main(argv) == 0
    return out, json.loads((out / "run.json").read_text())


def test_every_context_and_method_has_a_measured_row(run):
    _, doc = run
    rows = doc["rows"]
    assert [(r["context"], r["method"]) for r in rows] == [(c, m) for c in (64, 128) for m in METHODS]
    for r in rows:
        assert r["error"] is None
        assert len(r["latency_ms"]["all"]) == 2
        assert len(r["warmup_ms"]) == 1 and r["warmup_ms"][0] > 0  # the CPU default: one untimed step
        assert r["latency_ms"]["p10"] <= r["latency_ms"]["median"] <= r["latency_ms"]["p90"]
        assert r["tokens_per_second"] == pytest.approx(1e3 / r["latency_ms"]["mean"])
        assert r["peak_memory_growth"] >= r["kv_bytes"] > 0
        # each step's host time (building and queueing the next graph) is part of that step's interval
        host = r["host_ms"]["all"]
        assert len(host) == 2 and all(0 < h <= t + 1e-3 for h, t in zip(host, r["latency_ms"]["all"]))
        # the build (before mx.async_eval is called) is part of the host time
        build = r["build_ms"]["all"]
        assert len(build) == 2 and all(0 < b <= h + 1e-3 for b, h in zip(build, host))
    assert [r["cache"] for r in rows[:3]] == ["mlx-lm KVCache", "kvq KVQCache", "kvq KVQCache"]
    assert rows[1]["attend_implementation"] == "affine:mlx"
    # 2 timed steps with a flush every 32: the document says the flush's cost is misweighed (a new user's tiny run)
    assert any("--steps 2 is not a multiple of --flush 32" in n and "misweighs" in n for n in doc["notes"])


def test_a_batch_decodes_every_sequence_in_each_step(run, tmp_path):
    """``--batch 3``: every cache holds three sequences (three times the bytes of one), each step yields a token
    per sequence (tokens/s counts all three), and a kvq cache decodes them in one batch (no error)."""
    argv = ["bench", "e2e", "--model", "random:tiny", "--contexts", "64", "--methods", ",".join(METHODS), "--steps",
            "2", "--dtype", "float16", "--sinks", "0", "--window", "0", "--flush", "32", "--out", str(tmp_path),
            "--name", "b3", "--no-progress", "--no-plot", "--batch", "3"]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "b3.json").read_text())
    assert doc["settings"]["batch"] == 3
    one = {r["method"]: r for r in run[1]["rows"] if r["context"] == 64}
    for r in doc["rows"]:
        assert r["error"] is None
        assert r["kv_bytes"] == 3 * one[r["method"]]["kv_bytes"]
        assert r["tokens_per_second"] == pytest.approx(3e3 / r["latency_ms"]["mean"])
    assert "timed steps of 3 sequences at once" in (tmp_path / "b3.md").read_text()


def test_kv_bytes_follow_the_bits_accounting(run):
    _, doc = run
    by = {(r["context"], r["method"]): r for r in doc["rows"]}
    assert by[64, "kvcache"]["bits_per_coordinate"] == 16
    assert by[64, "affine:4"]["bits_per_coordinate"] == 4.5  # 4-bit codes + fp16 scale and bias per 64
    assert by[64, "turboquant:4"]["bits_per_coordinate"] == 4.25  # 4-bit codes + an fp16 norm per 64
    for (context, method), r in by.items():
        expected = r["bits_per_coordinate"] / 16
        assert r["kv_bytes_ratio"] == pytest.approx(expected, rel=0.03)
        assert r["memory_ratio"] == pytest.approx(expected, rel=0.1)  # measured with mx.get_active_memory
    # tiny: 2 layers x (K, V) x 2 heads x 256 preallocated tokens x 64 dims x 2 bytes
    assert by[64, "kvcache"]["kv_bytes"] == 2 * 2 * 2 * 256 * 64 * 2


def test_files_and_environment(run):
    out, doc = run
    assert (out / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| affine:4 | kvq KVQCache | 4.5 (4.5) |" in (out / "run.md").read_text()
    env = doc["environment"]
    assert env["command"].startswith("kvq bench e2e --model random:tiny --contexts 64,128")
    assert env["device_kind"] == "cpu" and env["mlx"] == mx.__version__ and env["kvq"] and env["date"]
    assert doc["model"]["layers"] == 2 and doc["model"]["dtype"] == "float16"
    assert doc["settings"]["fill"] == "random" and doc["settings"]["contexts"] == [64, 128]


def test_a_failing_method_is_recorded_and_the_run_goes_on(monkeypatch):
    model = random_model.build_random_model(random_model.random_config("tiny"), mx.float32)
    original = e2e.make_cache

    def make_cache(model, spec, settings):
        if spec.label == "affine:4":
            raise RuntimeError("[quantized_matmul] No implementation for problem shape")
        return original(model, spec, settings)

    monkeypatch.setattr(e2e, "make_cache", make_cache)
    settings = e2e.E2ESettings((32,), steps=1, warmup=0, progress=False)
    rows = e2e.E2EBench(model, settings).run(e2e.parse_methods("affine:4,turboquant:4", 64))
    assert [r["method"] for r in rows] == ["kvcache", "affine:4", "turboquant:4"]
    assert rows[1]["error"] == "RuntimeError: [quantized_matmul] No implementation for problem shape"
    assert rows[1]["kv_bytes_ratio"] is None
    assert rows[2]["error"] is None and rows[2]["tokens_per_second"] > 0


def test_rounds_interleave_the_caches_and_keep_every_step(monkeypatch):
    """``rounds=3``: every cache is filled before any decodes, then the caches take turns in the methods' order and
    its reverse; each row keeps all its rounds' timed steps (3 x steps), its first round's warmup plus one untimed
    step per later round, and the memory of its own cache (as in one-after-the-other rows)."""
    model = random_model.build_random_model(random_model.random_config("tiny"), mx.float32)
    events, original_fill, original_decode = [], e2e.fill, e2e.decode

    def logged_fill(caches, source, context, chunk):
        events.append(("fill", type(caches[0]).__name__))
        return original_fill(caches, source, context, chunk)

    def logged_decode(model, caches, token, steps, warmup, host, batch, build):
        events.append(("decode", type(caches[0]).__name__, warmup))
        return original_decode(model, caches, token, steps, warmup, host, batch, build)

    monkeypatch.setattr(e2e, "fill", logged_fill)
    monkeypatch.setattr(e2e, "decode", logged_decode)
    settings = e2e.E2ESettings((64,), steps=2, warmup=2, progress=False, sinks=0, window=0, rounds=3)
    rows = e2e.E2EBench(model, settings).run(e2e.parse_methods("affine:4", 64))
    kv, kvq = "KVCache", "KVQCache"
    assert events == [("fill", kv), ("fill", kvq), ("decode", kv, 2), ("decode", kvq, 2), ("decode", kvq, 1),
                      ("decode", kv, 1), ("decode", kv, 1), ("decode", kvq, 1)]
    one = {r["method"]: r for r in e2e.E2EBench(model, attrs.evolve(settings, rounds=1)).run(
        e2e.parse_methods("affine:4", 64))}
    for r in rows:
        assert r["error"] is None and len(r["latency_ms"]["all"]) == 6 and len(r["host_ms"]["all"]) == 6
        assert len(r["build_ms"]["all"]) == 6  # every round's steps, as the host times
        assert len(r["warmup_ms"]) == 2 + 1 + 1
        assert r["kv_bytes"] == one[r["method"]]["kv_bytes"]
        # its own decode peak, not the other cache's bytes that were resident beside it
        assert r["kv_bytes"] <= r["peak_memory_growth"] < r["kv_bytes"] + 4 * one[r["method"]]["peak_memory_growth"]
    assert rows[1]["speed_vs_fp16"] == pytest.approx(rows[1]["tokens_per_second"] / rows[0]["tokens_per_second"])


def test_a_method_failing_in_a_round_is_recorded_and_the_others_go_on(monkeypatch):
    model = random_model.build_random_model(random_model.random_config("tiny"), mx.float32)
    original, calls = e2e.decode, []

    def decode(model, caches, *args):
        calls.append(type(caches[0]).__name__)
        if type(caches[0]).__name__ == "KVQCache" and calls.count("KVQCache") == 2:
            raise RuntimeError("out of memory")
        return original(model, caches, *args)

    monkeypatch.setattr(e2e, "decode", decode)
    settings = e2e.E2ESettings((32,), steps=1, warmup=0, progress=False, rounds=3)
    rows = e2e.E2EBench(model, settings).run(e2e.parse_methods("affine:4", 64))
    assert calls == ["KVCache", "KVQCache", "KVQCache", "KVCache", "KVCache"]  # no third round for the failed one
    assert rows[1]["error"] == "RuntimeError: out of memory" and rows[1]["speed_vs_fp16"] is None
    assert rows[0]["error"] is None and len(rows[0]["latency_ms"]["all"]) == 3


def test_a_method_string_sets_its_own_flush():
    """``affine:4[flush=64]`` next to the run's ``flush`` (the default, 128): each cache flushes in its own
    blocks."""
    model = random_model.build_random_model(random_model.random_config("tiny"), mx.float32)
    settings = e2e.E2ESettings((32,), steps=1, warmup=0, progress=False)
    specs = e2e.parse_methods("affine:4,affine:4[flush=64]", 64)
    assert [e2e.make_cache(model, spec, settings)[0].config.flush for spec in specs[1:]] == [128, 64]


def test_fills_store_exactly_the_source():
    source = fill.RandomKV(kv_heads=2, head_dim=64, dtype=mx.float16, seed=3)
    caches = [KVCache(), KVCache()]
    fill.fill(caches, source, context=100, chunk=32)
    assert all(c.offset == 100 for c in caches)
    parts = [source(1, s, min(s + 32, 100)) for s in range(0, 100, 32)]  # the same (layer, start): same data
    assert mx.array_equal(mx.concatenate([k for k, _ in parts], axis=2), caches[1].keys[:, :, :100])
    assert mx.array_equal(mx.concatenate([v for _, v in parts], axis=2), caches[1].values[:, :, :100])


def test_replay_serves_the_real_prefill_as_new_memory():
    model = random_model.build_random_model(random_model.random_config("tiny"), mx.float32)
    ids = mx.arange(256) % 512
    replay = fill.ReplayKV(model, ids)
    reference = [KVCache() for _ in model.layers]
    model(ids[None], cache=reference)
    keys, values = replay(1, 8, 40)
    assert mx.allclose(keys, reference[1].keys[:, :, 8:40], atol=1e-5)
    assert mx.allclose(values, reference[1].values[:, :, 8:40], atol=1e-5)
    # 256 tokens fill a KVCache's first buffer exactly: without copies it would alias the replayed arrays
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    caches = [KVCache() for _ in model.layers]
    fill.fill(caches, replay, context=256, chunk=256)
    assert mx.get_active_memory() - before == sum(c.nbytes for c in caches) > 0


def test_methods_defaults_and_names():
    labels = [s.label for s in e2e.parse_methods(None, 128, installed={"fp16", "affine", "turboquant"})]
    assert labels == ["kvcache", "mlx-affine:4", "mlx-affine:8", "affine:4", "turboquant:4", "turboquant:k4v3",
                      "turboquant:3"]
    specs = e2e.parse_methods("kvq-fp16,mlx-affine:4", 64)
    assert [e2e.cache_kind(s) for s in specs] == ["mlx-lm KVCache", "kvq KVQCache", "mlx-lm QuantizedKVCache"]
    assert e2e.bits(specs[2], 64, mx.float16) == (4.5, 4.5)
    assert e2e.bits(specs[2], 64, mx.float32) == (5.0, 5.0)  # mlx-lm keeps scales in the model's dtype
    assert e2e.bits(specs[0], 64, mx.float32) == (32.0, 32.0)


def test_llama3_8b_preset_shape():
    config = random_model.random_config("random:llama3-8b", layers=4)
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"], config["vocab_size"],
            config["rope_theta"], config["max_position_embeddings"]) == (
        4, 4096, 32, 8, 128, 14336, 128256, 500000.0, 131072)
    assert random_model.random_config("llama3-8b")["num_hidden_layers"] == 32


@pytest.mark.parametrize("args, message", [
    (["--model", "random:llama3-9b"], "unknown random preset 'llama3-9b'; choose one of random:llama3-8b"),
    (["--model", "random:tiny", "--methods", "affine:x"], "bits 'x' must be an integer"),
    (["--model", "random:tiny", "--methods", "frobnicate:4"], "method must be one of"),
    (["--model", "random:tiny", "--contexts", "1024,0"], "--contexts must be positive integers"),
    (["--model", "random:tiny", "--contexts", "256K"], "longer than the model's max_position_embeddings (131072)"),
    (["--model", "random:tiny", "--layers", "3"], "--layers must be in 1..2"),
    (["--model", "random:tiny", "--fill", "prefill"], "have no text to prefill"),
    (["--model", "random:tiny", "--steps", "0"], "--steps must be >= 1"),
    (["--model", "random:tiny", "--batch", "0"], "--batch must be >= 1"),
    (["--model", "random:tiny", "--rounds", "0"], "--rounds must be >= 1"),
    (["--batch", "2"], "--batch 2 needs --fill random"),
    (["--contexts", "2048"], "longer than the model's max_position_embeddings (1024)"),
    (["--layers", "1"], "--layers applies to random:PRESET models only"),
])
def test_bad_input_fails_before_model_work(no_model_work, tmp_path, capsys, args, message):
    folder = tmp_path / "model"  # a model folder whose config allows 1024 positions (no weights)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64,
        "max_position_embeddings": 1024}))
    model = [] if "--model" in args else ["--model", str(folder)]
    assert main(["bench", "e2e", *model, *args, "--out", str(tmp_path / "out")]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_unknown_bench_subcommand_is_named(capsys):
    assert main(["bench", "e2f"]) == 1
    assert "unknown subcommand 'e2f'; choose one of e2e" in capsys.readouterr().err


def test_report_redraws_a_result(run, tmp_path, capsys):
    out, doc = run
    doc = {**doc, "rows": doc["rows"][:4]}  # a run cut short after four rows
    (tmp_path / "cut.json").write_text(json.dumps(doc))
    assert main(["bench", "e2e", "--report", str(tmp_path / "cut.json")]) == 0
    assert (tmp_path / "cut.png").read_bytes()[:4] == b"\x89PNG"
    assert "### 128 tokens of context" in (tmp_path / "cut.md").read_text()
    assert main(["bench", "e2e", "--report", str(out / "run.md")]) == 1
    assert "--report: cannot read" in capsys.readouterr().err


def test_kernel_durations_groups_each_calls_launches():
    """``benchmarks/kernel_durations.py`` turns ncu's CSV (one row per launch and metric, ns with thousands
    separators) into GPU time per call: fp16 SDPA one launch; a kvq call its counters' launch plus the tensor-core
    kernel (also with sinks and a window: one launch attends them), or the SIMT kernel plus its merge; warm-up
    calls dropped."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "kernel_durations.py"
    spec = importlib.util.spec_from_file_location("kernel_durations", path)
    kd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kd)
    head = '"ID","Process ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
    launches = [("cudnn_flash_sdpa_kernel", "140,960"), ("kvq_zero_counters_x", "1,568"),
                ("kvq_decode_attend_tc_x(const __half *)", "123,936"), ("kvq_zero_counters_x", "1,600"),
                ("kvq_decode_attend_tc_x(const __half *)", "120,000"), ("kvq_decode_attend_x", "256,896"),
                ("kvq_decode_merge_x", "19,904"), ("kvq_zero_counters_x", "9,000"),
                ("kvq_decode_attend_tc_x(const __half *)", "110,000")]
    rows = "".join(f'"{i}","7","{name}","gpu__time_duration.sum","ns","{ns}"\n'
                   f'"{i}","7","{name}","launch__grid_size","","1,024"\n' for i, (name, ns) in enumerate(launches))
    parsed = kd.parse_ncu_csv("==PROF== noise\n" + head + rows)
    assert [p["kernel"] for p in parsed] == [n for n, _ in launches]
    assert parsed[0]["gpu__time_duration.sum"] == pytest.approx(140.96) and parsed[0]["launch__grid_size"] == 1024
    labels = [{"T": 4096, "method": "fp16_sdpa"}, {"T": 4096, "method": "turboquant4", "warmup": True},
              {"T": 4096, "method": "turboquant4"}, {"T": 4096, "method": "turboquant4", "tc": False},
              {"T": 4096, "method": "turboquant4", "dense": True}]
    got = kd.group_calls(labels, parsed)
    assert [(r["method"], round(r["gpu_us"], 3), len(r["launches"])) for r in got] == [
        ("fp16_sdpa", 140.96, 1), ("turboquant4", 121.6, 2), ("turboquant4", 276.8, 2), ("turboquant4", 119.0, 2)]
    with pytest.raises(ValueError, match="no launch left"):
        kd.group_calls(labels + [{"T": 4096, "method": "affine4"}], parsed)


def test_ncu_source_summary_sums_samples_by_opcode_and_segment(tmp_path):
    """``benchmarks/ncu_source_summary.py`` reads ncu's SASS source page (a header row with ``Source``, counters with
    thousands separators) and sums the stall samples per opcode (predicates and modifiers dropped) and per segment
    between barriers, fences and exits; a file without that header is refused."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "ncu_source_summary.py"
    head = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb",' \
           '"stall_long_sb (Not Issued)"\n'
    rows = [("LDG.E R2, desc[UR4][R2.64]", "1,200", "64", "1,100"),
            ("@!P0 IMAD.WIDE.U32 R4, R5, 0x4, R6", "30", "64", "0"),
            ("BAR.SYNC.DEFER_BLOCKING 0x0", "5", "64", "0"), ("IMAD R7, R7, 0x2, RZ", "70", "32", "0"),
            ("EXIT", "0", "64", "0")]
    text = head + "".join(f'"{i:04x}","{s}","{n}","{e}","{ls}","0"\n' for i, (s, n, e, ls) in enumerate(rows))
    (tmp_path / "s.csv").write_text("==PROF== noise\n" + text)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "s.csv"), "--top", "2"], capture_output=True,
                         text=True, check=True).stdout
    assert "5 instructions, 1305 samples, 288 executed" in out
    assert "('LDG', 1200.0), ('IMAD', 100.0), ('BAR', 5.0)" in out
    assert "1235 ( 94.6% so far)" in out and "   70 (100.0% so far)" in out  # the segments up to BAR, then EXIT
    assert "[('long_sb', 1100)]" in out
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    bad = subprocess.run([sys.executable, str(script), str(tmp_path / "bad.csv")], capture_output=True, text=True)
    assert bad.returncode != 0 and "no header row with a 'Source' column" in bad.stderr


@pytest.mark.parametrize("on_cpu, argv, warmup", [
    (True, [], 1), (False, [], 129), (False, ["--flush", "8"], 9), (False, ["--warmup", "0"], 0)])
def test_default_warmup_leaves_the_first_flush_untimed_on_a_gpu(monkeypatch, on_cpu, argv, warmup):
    """On a GPU the first window flush compiles the quantize kernels for the block shape: the default warmup
    (flush + 1 steps) keeps it out of the timed steps; the CPU compiles nothing and keeps one warmup step."""
    from kvq.cli import bench_cmd

    monkeypatch.setattr(bench_cmd, "_on_cpu", lambda: on_cpu)
    args = bench_cmd.e2e_parser().parse_args(["--model", "random:tiny", "--methods", "fp16", *argv])
    assert bench_cmd.e2e_check(args)["settings"].warmup == warmup


def test_default_name_never_overwrites_an_earlier_run(tmp_path, capsys):
    """Two runs of one day, device and model: the second gets DATE-DEVICE-MODEL-2 and says so; --name overwrites
    (and says so too)."""
    argv = ["bench", "e2e", "--model", "random:tiny", "--contexts", "64", "--methods", "fp16,affine:4", "--steps",
            "1", "--warmup", "0", "--out", str(tmp_path), "--no-progress", "--no-plot"]
    assert main(argv) == 0
    (first,) = tmp_path.glob("*.json")
    capsys.readouterr()
    assert main(argv) == 0
    second = first.with_name(f"{first.stem}-2.json")
    err = capsys.readouterr().err
    assert f"keeping an earlier run's {tmp_path / first.stem}.*; writing {second}" in err
    assert "Note: --steps 1 is not a multiple of --flush 128" in err  # the document's notes reach the terminal
    assert set(tmp_path.glob("*.json")) == {first, second} and second.with_suffix(".md").exists()
    assert main([*argv, "--name", first.stem]) == 0
    assert f"overwriting {first} (--name {first.stem})" in capsys.readouterr().err
    assert set(tmp_path.glob("*.json")) == {first, second}
    # no kvq cache measured, no window flushes to weigh: no note about --flush
    assert main([*argv[:6], "--methods", "fp16", *argv[8:], "--name", "reference"]) == 0
    assert "--flush" not in capsys.readouterr().err
