"""The kvq command line: list and select, text and JSON, errors as one line with a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvq.cli import main


def test_list_shows_all_five_distributions(capsys):
    assert main(["list"]) == 0
    text = capsys.readouterr().out
    for dist in ("kvq-core", "kvq-backends-turboquant", "kvq-backends-qjl", "kvq-backends-vecinfer", "kvq-metal"):
        assert dist in text
    assert "affine:mlx" in text and "runs here" in text


def test_list_json(capsys):
    assert main(["list", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"fp16", "affine"} <= set(info["methods"])
    assert any(i["method"] == "affine" and i["runs_here"] for i in info["implementations"])


def test_select_prints_plan_and_reasons(capsys):
    assert main(["select", "affine", "--shape", "1,8,4096,128", "--param", "bits=3"]) == 0
    text = capsys.readouterr().out
    assert "AffineParams(bits=3, group_size=64)" in text and "attend" in text and "mlx: est." in text


def test_select_json_one_op(capsys):
    assert main(["select", "fp16", "--shape", "1,8,16,64", "--op", "attend", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert list(plan["ops"]) == ["attend"] and plan["ops"]["attend"]["backend"] == "mlx"


def test_errors_are_one_line_and_non_zero(capsys):
    assert main(["select", "affine", "--shape", "1,8,4096"]) == 1
    assert "--shape must be four non-negative integers" in capsys.readouterr().err
    assert main(["select", "nope", "--shape", "1,8,16,64"]) == 1
    assert "method must be one of" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2


def test_list_shows_plugins_that_kvq_load_plugins_left_out():
    code = "from kvq.cli import main; main(['list']); main(['list', '--json'])"
    env = {**os.environ, "KVQ_LOAD_PLUGINS": "baselines"}  # only kvq-core's own methods
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    text, _, document = out.partition("\n{")
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ") and "kvq" in line}
    assert rows["baselines"].endswith(" ok") and rows["turboquant"].endswith(" not loaded (KVQ_LOAD_PLUGINS)")
    loaded = {p["entry_point"]: p["loaded"] for p in json.loads("{" + document)["plugins"]}
    assert loaded["baselines"] and not loaded["turboquant"] and not loaded["qjl"]
