"""kvq autotune: crossover finding (kvq.bench.autotune), the stored table (kvq.tuning), selection following it
(and ignoring a bad one), the CLI."""

from __future__ import annotations

import json
import time

import pytest
from conftest import fake_kernel_class

import kvq
from kvq import tuning
from kvq.bench import autotune
from kvq.bench.autotune import find_crossover
from kvq.tuning import NEVER, AutotuneWarning
from kvq.cli import main


FakeKernel = fake_kernel_class()


class SlowKernel(FakeKernel):
    """A fake kernel whose quantize takes 0.1 s more than pure MLX's (sub-millisecond at these sizes)."""

    def kvq_quantize(self, x, params):
        time.sleep(0.1)
        return super().kvq_quantize(x, params)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh kvq cache dir for this test (tables written here, none inherited from the user's cache)."""
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def entry(crossover, op="attend", bits=4, label="affine:4"):
    return {"method": "affine", "label": label, "params": tuning.params_json(kvq.make_params("affine", bits=bits)),
            "op": op, "backend": "fake-kernel", "crossover": crossover, "sizes": [1024, 4096], "kernel_s": [1, 1],
            "mlx_s": [1, 1]}


def write_table(*entries):
    return tuning.save({"format": tuning.FORMAT, **tuning.identity(), "entries": list(entries)})


def attend_choice(T, bits=4, **kwargs):
    plan = kvq.select("affine", (1, 8, T, 128), op="attend", params=kvq.make_params("affine", bits=bits),
                      num_q_heads=32, **kwargs)
    return plan.choices["attend"]


@pytest.mark.parametrize("kernel_s, expected", [
    ([5, 5, 1, 1], 4096),       # faster from the third size on
    ([1, 1, 1, 1], 0),          # always faster
    ([1, 1, 1, 3], NEVER),      # slower at the largest size
    ([1, 5, 1, 1], 4096),       # faster at the smallest, slower at the second: from the third
    ([1, 1, 1, 2], NEVER),      # equal time at the largest size is not faster
])
def test_find_crossover(kernel_s, expected):
    assert find_crossover([1024, 2048, 4096, 16384], kernel_s, [2, 2, 2, 2]) == expected


@pytest.mark.parametrize("args, match", [
    (([], [], []), "non-empty"), (([1, 2], [1], [1, 2]), "of one length"), (([2, 1], [1, 1], [2, 2]), "ascending")])
def test_find_crossover_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        find_crossover(*args)


def test_table_path_is_keyed_by_device_mlx_and_kvq(cache):
    import mlx.core as mx

    path = tuning.table_path("cpu")
    assert path.parent == cache / "autotune"
    assert path.name.startswith("cpu_") and f"_mlx-{mx.__version__}_kvq-{kvq.__version__}.json" in path.name


def test_select_follows_the_measured_crossover(registered, cache):
    registered(FakeKernel())
    path = write_table(entry(4096))
    short, at, long = attend_choice(1024), attend_choice(4096), attend_choice(16384)
    assert short.backend == "mlx" and at.backend == "fake-kernel" and long.backend == "fake-kernel"
    assert f"measured crossover 4096 (kvq autotune, {path})" in short.reason
    assert "B*T=1024 < 4096, pure MLX is faster" in short.reason
    assert "B*T=16384 >= 4096, the fake-kernel kernel is faster" in long.reason
    assert tuning.crossover("affine", "attend", "fake-kernel", kvq.Problem("affine", "attend", (1, 8, 64, 128),
                              params=kvq.make_params("affine"))) == 4096
    # quantize has no entry: the cost model decides; 'require' considers kernels only, table or not
    quantize = kvq.select("affine", (1, 8, 1024, 128), op="quantize").choices["quantize"]
    assert quantize.backend == "fake-kernel" and "lowest cost of 2 supporting" in quantize.reason
    assert attend_choice(1024, kernels="require").backend == "fake-kernel"


def test_without_a_table_the_cost_model_decides(registered, cache):
    registered(FakeKernel())
    choice = attend_choice(1024)
    assert choice.backend == "fake-kernel" and "lowest cost of 2 supporting" in choice.reason
    assert "measured" not in choice.reason
    assert tuning.load() is None
    problem = kvq.Problem("affine", "attend", (1, 8, 64, 128))
    assert tuning.crossover("affine", "attend", "fake-kernel", problem) is None


def test_never_always_and_entries_of_other_parameters(registered, cache):
    registered(FakeKernel())
    write_table(entry("never"), entry(0, op="quantize"))
    assert attend_choice(131072).backend == "mlx"
    assert "measured crossover never" in attend_choice(131072).reason
    assert kvq.select("affine", (1, 1, 16, 128), op="quantize").choices["quantize"].backend == "fake-kernel"
    # an exact params match wins; without one, the largest crossover of that method/op/backend
    write_table(entry(10**6, bits=4), entry(16, bits=8, label="affine:8"))
    assert attend_choice(1024, bits=4).backend == "mlx"
    assert attend_choice(1024, bits=8).backend == "fake-kernel"
    other = attend_choice(1024, bits=2)
    assert other.backend == "mlx" and "(measured with affine:4, other parameters)" in other.reason


@pytest.mark.parametrize("content, reason", [
    ("{not json", "cannot read it as JSON"),
    (json.dumps({"format": "something-else", "entries": []}), "'format' is not"),
    ("BAD-ENTRY", "crossover must be an int >= 0 or 'never'"),
    ("OTHER-MLX", "measured with mlx '0.0.1'"),
])
def test_a_malformed_table_warns_and_is_ignored(registered, cache, content, reason):
    registered(FakeKernel())
    header = {"format": tuning.FORMAT, **tuning.identity()}
    if content == "BAD-ENTRY":
        content = json.dumps({**header, "entries": [entry(-3)]})
    elif content == "OTHER-MLX":
        content = json.dumps({**header, "mlx": "0.0.1", "entries": [entry(4096)]})
    path = tuning.table_path()
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.warns(AutotuneWarning, match=rf"{path.name} is ignored: .*{reason}"):
        choice = attend_choice(1024)
    assert choice.backend == "fake-kernel" and "lowest cost" in choice.reason


def test_kvq_select_shows_the_measured_crossover(registered, cache, capsys):
    registered(FakeKernel())
    path = write_table(entry(4096))
    assert main(["select", "affine", "--shape", "1,8,1024,128", "--op", "attend"]) == 0
    out = capsys.readouterr().out
    assert "attend     -> mlx:" in out and f"measured crossover 4096 (kvq autotune, {path})" in out


def test_kvq_autotune_on_the_cpu_measures_no_kernel(cache, capsys):
    """On the CPU only pure MLX runs (kvq_metal's kernels are for GPUs): the stored table has no entries."""
    assert main(["autotune", "--methods", "affine:4", "--sizes", "64,128", "--contexts", "64", "--reps", "1",
                 "--warmup", "0", "--no-progress"]) == 0
    table = json.loads(tuning.table_path().read_text())
    assert table["entries"] == [] and table["grid"]["measured"] == [] and table["device_kind"] == "cpu"
    assert "no kernel runs on this cpu device" in capsys.readouterr().out
    assert tuning.load().entries == ()


def test_kvq_autotune_finds_a_slower_kernel_never_wins_and_select_follows(registered, cache, tmp_path, capsys):
    registered(SlowKernel())
    assert kvq.select("affine", (1, 8, 16, 128), op="quantize").choices["quantize"].backend == "fake-kernel"
    assert main(["autotune", "--methods", "affine:4", "--ops", "quantize", "--sizes", "64,128", "--reps", "3",
                 "--warmup", "0", "--no-progress", "--out-dir", str(tmp_path / "results")]) == 0
    (stored,) = json.loads(tuning.table_path().read_text())["entries"]
    assert (stored["op"], stored["backend"], stored["crossover"], stored["sizes"]) == ("quantize", "fake-kernel",
                                                                                       "never", [64, 128])
    assert all(k > m + 0.05 for k, m in zip(stored["kernel_s"], stored["mlx_s"]))
    assert (tmp_path / "results" / f"autotune_{tuning.table_path().name}").is_file()
    choice = kvq.select("affine", (1, 8, 16, 128), op="quantize").choices["quantize"]
    assert choice.backend == "mlx" and "measured crossover never" in choice.reason
    assert "fake-kernel kernel faster: never" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv, match", [
    (["--methods", "nope:4"], "unknown method 'nope'"), (["--ops", "attend,pack"], "--ops must be"),
    (["--reps", "0"], "--reps >= 1")])
def test_kvq_autotune_rejects_bad_arguments_before_measuring(cache, monkeypatch, capsys, argv, match):
    monkeypatch.setattr(autotune, "measure", lambda *a, **k: pytest.fail("measured despite a bad argument"))
    assert main(["autotune", *argv]) == 1
    assert match in capsys.readouterr().err
    assert not tuning.table_path().exists()


def bench_document(**env):
    """A kvq bench ops result: affine:4 quantize, the fake kernel faster from N = 256 on."""
    rows = [{"method": "affine:4", "op": "quantize", "implementation": impl, "size": n, "median_s": s}
            for n, k_s in ((64, 3.0), (128, 3.0), (256, 1.0), (512, 1.0))
            for impl, s in (("mlx", 2.0), ("fake-kernel", k_s))]
    rows.append({"method": "fp16", "op": "attend", "implementation": "mx.fast.sdpa", "size": 64, "median_s": 1.0})
    settings = {"methods": ["affine:4"], "head_dim": 128, "sizes": [64, 128, 256, 512], "contexts": [64],
                "warmup": 1, "reps": 3}
    environment = {**tuning.identity(), "command": "kvq bench ops --methods affine:4", **env}
    return {"benchmark": "kvq bench ops", "environment": environment, "settings": settings, "rows": rows}


def test_kvq_autotune_from_a_bench_ops_result(registered, cache, tmp_path, capsys):
    registered(FakeKernel())
    bench = tmp_path / "bench_ops.json"
    bench.write_text(json.dumps(bench_document()))
    assert main(["autotune", "--from-bench", str(bench)]) == 0
    (stored,) = json.loads(tuning.table_path().read_text())["entries"]
    assert (stored["op"], stored["crossover"], stored["verdict"]) == ("quantize", 256, "from 256")
    assert [kvq.select("affine", (1, 8, T, 128), op="quantize").choices["quantize"].backend for T in (16, 32)] == \
        ["mlx", "fake-kernel"]  # N = 8 * T vectors: 128 < 256 <= 256
    bench.write_text(json.dumps(bench_document(device="Another GPU")))
    assert main(["autotune", "--from-bench", str(bench)]) == 1
    assert "--from-bench: measured with device 'Another GPU'" in capsys.readouterr().err
