"""kvq bench capacity (#22's capacity benchmark): the batch chosen from two probes, measured within the budget, kvq's
caches fitting more sequences than fp16's, the chosen batch's decode timed --reps times and reported as their median
and range; bad input refused before any model work."""

from __future__ import annotations

import json
import re
import statistics

import pytest

from kvq.bench.capacity import CapacitySettings, predicted_batch
from kvq.bench.output import median_range
from kvq.cli import main


def test_predicted_batch_follows_the_line_through_the_probes():
    # peaks 10 and 14 bytes at 1 and 2 sequences: 6 fixed + 4 per sequence; (100 - 6) // 4 = 23
    assert predicted_batch({1: 10, 2: 14}, 100, 1.0, 1024) == 23
    assert predicted_batch({1: 10, 2: 14}, 100, 0.5, 1024) == 11  # (50 - 6) // 4
    assert predicted_batch({1: 10, 2: 14}, 100, 1.0, 8) == 8
    assert predicted_batch({1: 10, 2: 14}, 5, 1.0, 8) == 1  # nothing fits: still one sequence tried
    with pytest.raises(ValueError, match="needs peaks at two batch sizes"):
        predicted_batch({1: 10}, 100, 1.0, 8)
    with pytest.raises(ValueError, match=r"safety must be in \(0, 1\]; got 1.5"):
        CapacitySettings(context=64, budget=1, safety=1.5)
    with pytest.raises(ValueError, match="reps must be >= 1; got 0"):
        CapacitySettings(context=64, budget=1, reps=0)


def _fake_rows(monkeypatch, peak_of, kv_of=lambda b: 1):
    """CapacityBench rows without a model: batch B peaks at ``peak_of(B)`` bytes above a base of 0 and its caches
    hold ``kv_of(B)`` bytes; the n-th row decodes B * n tokens/s in steps of 1000 / n ms (host 0.1 ms), so
    repetitions differ."""
    import mlx.core as mx

    from kvq.bench import capacity

    tried = []

    def row(self, spec, batch, steps):
        tried.append(batch)
        n = len(tried)
        return {"error": None, "peak_memory": peak_of(batch), "tokens_per_second": float(batch * n),
                "kv_bytes": kv_of(batch),
                "latency_ms": {"mean": 1000 / n}, "host_ms": {"median": 0.1}}

    monkeypatch.setattr(capacity.CapacityBench, "_row", row)
    monkeypatch.setattr(mx, "get_active_memory", lambda: 0)
    monkeypatch.setattr(capacity, "release", lambda: None)
    return tried


def test_a_cautious_first_prediction_is_measured_again_from_its_own_peak(monkeypatch):
    """Probes at 1 and 2 sequences overstate one more sequence (the noise a new user saw: 1.5 against 2.3 MiB per
    sequence in two runs); the batch predicted from them fits at once, so the line through the probe at 1 and that
    batch's measured peak predicts again, and the larger batch is measured and kept. A batch at --max-batch is
    marked. The chosen batch is timed once more (--reps 2), after the search."""
    from kvq.bench.capacity import CapacityBench

    tried = _fake_rows(monkeypatch, lambda b: 100 + 10 * b + (30 if b == 2 else 0))  # probe at 2 reads 30 high
    settings = CapacitySettings(context=64, budget=1000, safety=1.0, max_batch=1024)
    (result,) = CapacityBench(None, settings).run([_spec("fp16")])
    # probes: 110 and 150 -> 40 per sequence -> 23; measured 330 at 23 -> 10 per sequence -> 90 fits (1000)
    assert tried == [1, 2, 23, 90, 90] and result["max_batch"] == 90 and not result["at_max_batch"]
    tried = _fake_rows(monkeypatch, lambda b: 100 + 10 * b)
    (result,) = CapacityBench(None, CapacitySettings(context=64, budget=1000, safety=1.0, max_batch=50)).run(
        [_spec("fp16")])
    assert tried == [1, 2, 50, 50] and result["max_batch"] == 50 and result["at_max_batch"]


def test_the_slope_of_the_probes_is_never_below_the_caches_own_bytes_per_sequence(monkeypatch):
    """On an H100 mlx-lm's KVCache at 32K peaked only 2.3 GB higher at 2 sequences than at 1 while each held 4.3 GB:
    the batch predicted from that slope (25) did not fit, nor did the two tried below it. The cache's bytes per
    sequence (the probe at 2's, halved) bound one more sequence's bytes from below."""
    from kvq.bench.capacity import CapacityBench

    # 100 fixed + 40 per sequence, but the probe at 2 reads 30 low (slope 10); the caches hold 40 per sequence
    tried = _fake_rows(monkeypatch, lambda b: 100 + 40 * b - (30 if b == 2 else 0), kv_of=lambda b: 40 * b)
    (result,) = CapacityBench(None, CapacitySettings(context=64, budget=1000, safety=1.0)).run([_spec("fp16")])
    # slope 10 alone: (1000 - 130) // 10 = 87, peak 3580; at least 40: (1000 - 100) // 40 = 22, peak 980
    assert tried == [1, 2, 22, 22] and result["max_batch"] == 22 and not result["error"]
    assert result["per_sequence_bytes"] == 10 and result["cache_bytes_per_sequence"] == 40
    assert predicted_batch({1: 140, 2: 150}, 1000, 1.0, 1024, least_per_sequence=40) == 22
    assert predicted_batch({1: 140, 2: 150}, 1000, 1.0, 1024) == 87


def test_the_chosen_batch_is_timed_reps_times_and_reported_as_their_median(monkeypatch):
    """--reps 3: the row that showed the batch fits (the 3rd row measured), then two more at that batch (the 4th
    and 5th); tokens/s is their median, the range and every repetition beside it, ratios from the medians."""
    from kvq.bench.capacity import CapacityBench

    tried = _fake_rows(monkeypatch, lambda b: 100 + 10 * b)
    settings = CapacitySettings(context=64, budget=1000, safety=1.0, max_batch=50, reps=3)
    fp16, tq3 = CapacityBench(None, settings).run([_spec("fp16"), _spec("turboquant:3")])
    assert tried == [1, 2, 50, 50, 50] * 2
    assert [r["tokens_per_second"] for r in fp16["reps"]] == [150.0, 200.0, 250.0]
    assert fp16["tokens_per_second"] == 200.0 and fp16["row"]["tokens_per_second"] == 150.0
    assert fp16["tokens_per_second_spread"] == {"median": 200.0, "min": 150.0, "max": 250.0,
                                                "all": [150.0, 200.0, 250.0]}
    assert fp16["step_ms"] == {"median": 250.0, "min": 200.0, "max": 1000 / 3, "all": [1000 / 3, 250.0, 200.0]}
    assert fp16["host_ms"]["all"] == [0.1] * 3 and [r["error"] for r in fp16["reps"]] == [None] * 3
    # turboquant:3's rows are the 6th to 10th: 50 * (8, 9, 10) tokens/s at the chosen batch
    assert tq3["tokens_per_second"] == 450.0 and tq3["tokens_vs_fp16"] == 450.0 / 200.0
    assert statistics.median(r["tokens_per_second"] for r in tq3["reps"]) == tq3["tokens_per_second"]


def test_a_batch_whose_repetition_does_not_fit_is_not_the_capacity(monkeypatch):
    """On an H100 turboquant:4's search chose 54 sequences whose first row peaked within the budget, and the second
    timed decode at 54 ran out of device memory: a batch fits only if every repetition runs within the budget. Here
    the 2nd row at 50 sequences fails, 46-49 run out of memory at once, and 45's 2nd row peaks above the budget:
    the search steps down a tenth from each failed repetition (50 -> 45 -> 40), narrows the gap above each batch
    that fitted (47 and 46 above 45; 42, 43 and 44 above 40, :data:`MAX_NARROW` of them) and reports 44, timed
    twice; the failed rows stay in ``tries``."""
    import mlx.core as mx

    from kvq.bench import capacity
    from kvq.bench.capacity import CapacityBench

    tried = []

    def row(self, spec, batch, steps):
        tried.append(batch)
        n = sum(b == batch for b in tried)  # this batch's n-th row
        failing = (batch == 50 and n == 2) or 45 < batch < 50
        peak = 1200 if batch == 45 and n == 2 else 100 + 10 * batch
        return {"error": "out of memory" if failing else None, "peak_memory": None if failing else peak,
                "tokens_per_second": float(batch), "kv_bytes": 1, "latency_ms": {"mean": 1.0},
                "host_ms": {"median": 0.1}}

    monkeypatch.setattr(capacity.CapacityBench, "_row", row)
    monkeypatch.setattr(mx, "get_active_memory", lambda: 0)
    monkeypatch.setattr(capacity, "release", lambda: None)
    settings = CapacitySettings(context=64, budget=1000, safety=1.0, max_batch=50, reps=2)
    (result,) = CapacityBench(None, settings).run([_spec("fp16")])
    assert tried == [1, 2, 50, 50, 45, 47, 46, 45, 40, 42, 43, 44, 44]
    assert result["max_batch"] == 44 and not result["error"] and result["row"]["tokens_per_second"] == 44.0
    assert [r["tokens_per_second"] for r in result["reps"]] == [44.0, 44.0] and result["peak_memory"] == 540
    oom = "out of memory"
    assert [(t["batch"], t["error"], t.get("repetition")) for t in result["tries"]] == [
        (50, None, None), (50, oom, 2), (45, None, None), (47, oom, None), (46, oom, None),
        (45, "a repetition peaked above the budget", 2), (40, None, None), (42, None, None), (43, None, None),
        (44, None, None)]
    assert not result["at_max_batch"]
    # every try failing at its repetition: MAX_TRIES batches, then the error names the first and the last
    tried.clear()
    monkeypatch.setattr(capacity.CapacityBench, "_row", lambda self, spec, batch, steps: (
        tried.append(batch), {"error": None if tried.count(batch) == 1 else "out of memory",
                              "peak_memory": 100, "tokens_per_second": 1.0, "kv_bytes": 1,
                              "latency_ms": {"mean": 1.0}, "host_ms": {"median": 0.1}})[1])
    (result,) = CapacityBench(None, settings).run([_spec("fp16")])
    assert result["error"].startswith("no batch from 50 down fit the budget") and "max_batch" not in result


def test_a_larger_batch_whose_repetition_does_not_fit_falls_back_to_the_batch_that_fitted(monkeypatch):
    """The first prediction (23) fits at once, the line through it predicts 90, which fits once and then fails a
    repetition: the search measures 23 again (it fitted) instead of stepping down from 90, then halves the gap up to
    90 (56, 73, 81: :data:`MAX_NARROW` batches, each fitting) and times 81 again."""
    import mlx.core as mx

    from kvq.bench import capacity
    from kvq.bench.capacity import CapacityBench

    tried = []

    def row(self, spec, batch, steps):
        tried.append(batch)
        failing = batch == 90 and tried.count(90) == 2
        return {"error": "out of memory" if failing else None, "peak_memory": None if failing else
                100 + 10 * batch + (30 if batch == 2 else 0), "tokens_per_second": float(batch), "kv_bytes": 1,
                "latency_ms": {"mean": 1.0}, "host_ms": {"median": 0.1}}

    monkeypatch.setattr(capacity.CapacityBench, "_row", row)
    monkeypatch.setattr(mx, "get_active_memory", lambda: 0)
    monkeypatch.setattr(capacity, "release", lambda: None)
    (result,) = CapacityBench(None, CapacitySettings(context=64, budget=1000, safety=1.0, reps=2)).run(
        [_spec("fp16")])
    assert tried == [1, 2, 23, 90, 90, 23, 56, 73, 81, 81] and result["max_batch"] == 81 and not result["error"]


def test_a_batch_that_runs_out_of_memory_is_narrowed_to_from_below(monkeypatch):
    """On an H100 turboquant:3's probes predicted 71 sequences of 32K, 71 ran out of memory, and the tenth's step
    down (63) was reported, where 69 had fitted the day before. Now the gap between the batch that fitted and the one
    that did not is halved (67, then 69, which is within a thirty-second of 71): 69 is the capacity, timed twice."""
    import mlx.core as mx

    from kvq.bench import capacity
    from kvq.bench.capacity import CapacityBench

    tried = []

    def row(self, spec, batch, steps):
        tried.append(batch)
        oom = batch >= 70
        return {"error": "out of memory" if oom else None, "peak_memory": None if oom else 100 + 10 * batch,
                "tokens_per_second": float(batch), "kv_bytes": 1, "latency_ms": {"mean": 1.0},
                "host_ms": {"median": 0.1}}

    monkeypatch.setattr(capacity.CapacityBench, "_row", row)
    monkeypatch.setattr(mx, "get_active_memory", lambda: 0)
    monkeypatch.setattr(capacity, "release", lambda: None)
    (result,) = CapacityBench(None, CapacitySettings(context=64, budget=810, safety=1.0, reps=2)).run(
        [_spec("fp16")])
    assert tried == [1, 2, 71, 63, 67, 69, 69] and result["max_batch"] == 69 and not result["error"]
    assert [t["batch"] for t in result["tries"] if t["error"]] == [71]


def test_a_run_whose_every_row_fails_exits_1(tmp_path, capsys):
    """A budget below the model itself: every row fails, each saying why, and the command exits 1 (a script must
    not read success); the files are still written. Sequences this short compress nothing: a note says so."""
    assert main(["bench", "capacity", "--model", "random:tiny", "--context", "64", "--budget", "1M", "--steps", "2",
                 "--methods", "kvcache,turboquant:3", "--no-progress", "--no-plot", "--out", str(tmp_path),
                 "--name", "cap"]) == 1
    document = json.loads((tmp_path / "cap.json").read_text())
    assert len(document["rows"]) == 2 and all("more than the budget" in row["error"] for row in document["rows"])
    err = capsys.readouterr().err
    assert "every row failed" in err
    # 64 tokens + 2 steps stay within the default sinks and window: said before the run, and in the files
    assert err.count("nothing is compressed") == 2 and "nothing is compressed" in document["notes"][0]
    assert "Note: sequences of 64 tokens" in (tmp_path / "cap.md").read_text()


def _spec(label):
    from kvq.evaluation.spec import parse_method

    return parse_method(label)


def test_kvq_caches_fit_more_sequences_within_the_budget(tmp_path, capsys):
    assert main(["bench", "capacity", "--model", "random:tiny", "--context", "1K", "--budget", "48M", "--steps", "2",
                 "--methods", "fp16,turboquant:3", "--window", "16", "--flush", "8", "--no-progress", "--no-plot",
                 "--out", str(tmp_path), "--name", "cap"]) == 0
    document = json.loads((tmp_path / "cap.json").read_text())
    fp16, tq3 = document["rows"]
    assert fp16["method"] == "kvcache" and not fp16["error"] and not tq3["error"]
    for row in (fp16, tq3):
        assert row["peak_memory"] <= document["settings"]["budget"] and row["tokens_per_second"] > 0
        assert row["row"]["batch"] == row["max_batch"] >= 1
        # two timed decodes at the chosen batch (--reps' default), the reported speed their median
        speeds = [r["tokens_per_second"] for r in row["reps"]]
        assert len(speeds) == 2 and row["tokens_per_second"] == statistics.median(speeds)
        assert speeds[0] == row["row"]["tokens_per_second"]
        assert row["step_ms"]["all"] == [r["step_ms"] for r in row["reps"]]
        assert all(0 < r["build_ms"] <= r["host_ms"] for r in row["reps"])
        assert row["build_ms"]["all"] == [r["build_ms"] for r in row["reps"]]
        assert row["peak_memory"] == max(r["peak_memory"] for r in row["reps"])
    # a 3.25-bit cache with a 16-token window holds a 1K-token sequence in far fewer bytes than fp16 does
    assert tq3["per_sequence_bytes"] < 0.6 * fp16["per_sequence_bytes"]
    assert tq3["max_batch"] > fp16["max_batch"] and tq3["batch_vs_fp16"] == tq3["max_batch"] / fp16["max_batch"]
    text = (tmp_path / "cap.md").read_text()
    assert "sequences that fit (x kvcache)" in text and "2 timed decodes at the chosen batch" in text
    assert median_range(tq3["tokens_per_second_spread"], ",.1f") in text and document["settings"]["reps"] == 2


@pytest.mark.parametrize("argv, message", [
    (["--model", "random:tiny"], "--budget is required here: this device reports no memory size"),
    (["--model", "random:tiny", "--budget", "1G", "--context", "1K,2K"], "--context takes one size in tokens"),
    (["--model", "random:tiny", "--budget", "1G", "--safety", "0"], r"--safety must be in \(0, 1\]; got 0.0"),
    (["--model", "random:tiny", "--budget", "lots"], "--budget takes one positive size in bytes"),
    (["--model", "random:tiny", "--budget", "16M,32M"], "--budget takes one size in bytes"),
    (["--model", "random:tiny", "--budget", "1G", "--reps", "0"], "--reps must be >= 1; got 0"),
])
def test_bad_input_is_refused_before_model_work(argv, message, capsys, no_model_work):
    assert main(["bench", "capacity", *argv, "--no-plot"]) == 1
    err = capsys.readouterr().err
    assert "kvq bench capacity: error:" in err and re.search(message, err), err


@pytest.mark.parametrize("argv, steps", [([], 128), (["--flush", "8"], 8), (["--steps", "3"], 3)])
def test_default_steps_time_one_whole_flush_period(argv, steps):
    """Without ``--steps`` the timed steps are ``--flush`` (the default flush, 128): each row times one flush."""
    from kvq.cli import bench_capacity_cmd

    args = bench_capacity_cmd.parser().parse_args(["--model", "random:tiny", "--budget", "48M", *argv])
    assert bench_capacity_cmd.check(args)["settings"].steps == steps
