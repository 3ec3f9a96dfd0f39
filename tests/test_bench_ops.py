"""kvq bench ops on the CPU at tiny sizes: every row, the byte counts, the PNGs, and bad arguments caught first."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from conftest import fake_kernel_class

from kvq.bench import measure, ops
from kvq.cli import bench_ops_cmd

TINY = ["--sizes", "64,128", "--contexts", "32,64", "--reps", "2", "--warmup", "0", "--bandwidth-bytes", "1M",
        "--no-progress", "--dtype", "float16"]


FakeKernel = fake_kernel_class()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One tiny run of two methods, all ops, with pure MLX and a fake kernel both measured."""
    import kvq

    fake = kvq.register(FakeKernel())
    out = tmp_path_factory.mktemp("bench-ops")
    try:
        assert bench_ops_cmd.main(["--methods", "affine:4,affine:2[group_size=32]", "--out", str(out), *TINY]) == 0
    finally:
        kvq.unregister(fake)
    return out, json.loads((out / "bench_ops.json").read_text())


def test_every_method_op_size_and_implementation_has_a_row(run):
    _, doc = run
    got = sorted((r["method"], r["op"], r["size"], r["implementation"]) for r in doc["rows"])
    methods, impls = ("affine:4", "affine:2[group_size=32]"), ("fake-kernel", "mlx")
    want = [(m, op, n, i) for m in methods for op in ("quantize", "dequantize") for n in (64, 128) for i in impls]
    want += [(m, "attend", t, i) for m in methods for t in (32, 64) for i in impls]
    want += [("fp16", "attend", t, ops.SDPA) for t in (32, 64)]
    assert got == sorted(want)
    for row in doc["rows"]:
        assert 0 < row["min_s"] <= row["median_s"] and row["reps"] == 2
        assert row["peak_delta_bytes"] >= row["output_bytes"] > 0
        expected = None if row["implementation"] == ops.SDPA else row["implementation"] == "fake-kernel"
        assert row["selected"] == expected


def test_shapes_and_bytes(run):
    _, doc = run
    rows = {(r["method"], r["op"], r["size"], r["implementation"]): r for r in doc["rows"]}
    quantize = rows[("affine:4", "quantize", 128, "mlx")]
    assert quantize["shape"] == [1, 8, 16, 128] and quantize["input_bytes"] == 128 * 128 * 2
    # affine 4-bit, group 64: 64 bytes of codes + 2 fp16 scales + 2 fp16 biases per vector
    assert quantize["output_bytes"] == 128 * (64 + 4 + 4)
    attend = rows[("affine:4", "attend", 32, "mlx")]
    assert attend["shape"] == [1, 8, 32, 128] and attend["kv_bytes"] == 2 * 8 * 32 * 72
    assert attend["output_bytes"] == 32 * 128 * 4 + 32 * 4  # float32 out [1, 32, 1, 128] and lse [1, 32, 1]
    assert attend["bandwidth_Bps"] == pytest.approx(attend["kv_bytes"] / attend["median_s"])
    assert attend["bandwidth_fraction"] == pytest.approx(
        attend["bandwidth_Bps"] / doc["elementwise_bandwidth"]["bandwidth_Bps"])
    sdpa = rows[("fp16", "attend", 64, ops.SDPA)]
    assert sdpa["kv_bytes"] == 2 * 8 * 64 * 128 * 2
    assert doc["elementwise_bandwidth"]["bytes_moved"] == 2 * 2**20


def test_environment_and_plots(run):
    out, doc = run
    env = doc["environment"]
    assert env["mlx"] == mx.__version__ and env["device_kind"] == "cpu" and env["device"]
    assert env["command"].startswith("kvq bench ops --methods 'affine:4,affine:2[group_size=32]' --out ")
    assert doc["settings"]["attend_shape"] == {"B": 1, "H_q": 32, "H_kv": 8, "T_q": 1}
    assert doc["complete"] is True and doc["plots"] == ["ops_quantize.png", "ops_dequantize.png", "ops_attend.png"]
    for name in doc["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, match", [
    (["--methods", "nope:4"], r"unknown method 'nope' in 'nope:4'; installed: ([a-z0-9_]+, )*affine, "),
    (["--methods", "affine:7"], r"--methods: 'affine:7': affine bits must be one of 2, 3, 4, 5, 6, 8; got 7"),
    (["--methods", "affine:4+fp16"], r"measures one method's ops"),
    (["--methods", "affine:4,affine:4"], r"given more than once"),
    (["--ops", "quantize,compress"], r"--ops must be a comma-separated subset of quantize, dequantize, attend"),
    (["--sizes", "1K,0"], r"--sizes must be positive integers"),
    (["--contexts", "4X"], r"--contexts must be positive integers"),
])
def test_bad_arguments_fail_before_any_work(tmp_path, monkeypatch, argv, match):
    def no_work(*args, **kwargs):
        pytest.fail("measured despite a bad argument")

    monkeypatch.setattr(ops, "run", no_work)
    monkeypatch.setattr(measure, "elementwise_bandwidth", no_work)
    with pytest.raises(ValueError, match=match):
        bench_ops_cmd.main([*argv, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_parse_sizes():
    assert ops.parse_sizes("4K,256,1M,4k") == (256, 4096, 2**20)
    assert ops.codec_shape(96, 128) == (1, 8, 12, 128) and ops.codec_shape(7, 64) == (1, 1, 7, 64)


def test_run_reports_each_step():
    """``on_step`` sees the rows so far after each (op, size): the CLI writes its JSON then."""
    seen = []
    settings = ops.Settings(ops.parse_methods("affine:4"), ("quantize",), (64, 128), (), warmup=0, reps=1)
    result = ops.run(settings, on_step=lambda r: seen.append([row["size"] for row in r["rows"]]))
    assert seen == [[64], [64, 128]] and [r["size"] for r in result["rows"]] == [64, 128]


def test_kvq_bench_ops_is_a_bench_subcommand(capsys):
    from kvq.cli import main

    assert main(["bench", "ops", "--ops", "quantize,compress"]) == 1
    assert "kvq bench ops: error: --ops must be a comma-separated subset of" in capsys.readouterr().err


def test_the_cpu_measures_in_float32_by_default_and_the_reference_row_says_its_dtype(tmp_path, capsys):
    """On the CPU ``--dtype`` defaults to float32 (MLX's 16-bit attention there is several times slower than its
    float32: in float16 the reference looked slower than kvq's attention), the reference row is named after its
    dtype and the summary says which dtype was measured."""
    assert bench_ops_cmd.settings_from(bench_ops_cmd.parser().parse_args([])).dtype == mx.float32
    tiny = TINY[:-2] + ["--ops", "attend", "--methods", "affine:4", "--no-plot", "--out", str(tmp_path)]
    assert bench_ops_cmd.main(tiny) == 0
    doc = json.loads((tmp_path / "bench_ops.json").read_text())
    assert doc["settings"]["dtype"] == "float32"
    assert {r["method"] for r in doc["rows"] if r["implementation"] == ops.SDPA} == {"fp32"}
    assert {r["dtype"] for r in doc["rows"]} == {"float32"}
    assert "\nfloat32; elementwise bandwidth" in capsys.readouterr().out
