"""matplotlib is kvq-core's ``plots`` extra: ``import kvq`` and the cache never import it, and a command that
draws plots without it fails before measuring anything, naming the install command (or runs with ``--no-plot``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvq.bench import measure, ops
from kvq.cli import main

TINY_OPS = ["--methods", "affine:4", "--ops", "quantize", "--sizes", "64", "--reps", "1", "--warmup", "0",
            "--bandwidth-bytes", "1M", "--no-progress"]
#: kvq-core comes from this clone in the workspace (editable), so the command installs the clone's folder so too,
#: with the extra, into this interpreter (no activated environment needed) and without the workspace's sources
INSTALL = (f"uv pip install --python {sys.executable} --no-sources "
           f"-e '{Path(__file__).resolve().parents[1] / 'kvq_core'}[plots]'")

CACHE_PATH = """
import sys
import mlx.core as mx
from mlx_lm.models import llama
import kvq

args = llama.ModelArgs.from_dict(dict(model_type="llama", hidden_size=128, num_hidden_layers=1, intermediate_size=128,
    num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=32, rope_theta=1e4))
model = llama.Model(args)
cache = kvq.make_prompt_cache(model, "affine", sinks=0, window=0)
mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=cache))
print(sorted({name.split(".")[0] for name in sys.modules} & {"matplotlib", "gguf", "kvq_example_plugin"}))
print(sorted(name for name in sys.modules if name.split(".")[:2] in (["kvq", "bench"], ["kvq", "evaluation"],
                                                                       ["kvq", "cli"])))
"""


@pytest.fixture
def no_matplotlib(monkeypatch):
    """matplotlib as if it were not installed (``import matplotlib`` raises ImportError)."""
    for name in [n for n in sys.modules if n.split(".")[0] == "matplotlib"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_import_kvq_and_the_cache_path_import_no_tooling():
    out = subprocess.run([sys.executable, "-c", CACHE_PATH], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", "[]"]


def test_bench_ops_without_matplotlib_fails_before_measuring(no_matplotlib, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(ops, "run", lambda *a, **k: pytest.fail("measured without matplotlib for the plots"))
    monkeypatch.setattr(measure, "elementwise_bandwidth", lambda *a, **k: pytest.fail("measured"))
    assert main(["bench", "ops", *TINY_OPS, "--out", str(tmp_path)]) == 1
    assert INSTALL in capsys.readouterr().err


def test_bench_ops_with_no_plot_needs_no_matplotlib(no_matplotlib, tmp_path):
    assert main(["bench", "ops", *TINY_OPS, "--out", str(tmp_path), "--no-plot"]) == 0
    document = json.loads((tmp_path / "bench_ops.json").read_text())
    assert document["complete"] is True and document["plots"] == [] and not list(tmp_path.glob("*.png"))


def test_bench_e2e_without_matplotlib_fails_before_building_a_model(no_matplotlib, monkeypatch, tmp_path, capsys):
    from kvq.cli import bench_cmd

    monkeypatch.setattr(bench_cmd, "_load", lambda *a, **k: pytest.fail("built a model without matplotlib"))
    argv = ["bench", "e2e", "--model", "random:tiny", "--contexts", "64", "--out", str(tmp_path)]
    assert main(argv) == 1
    assert INSTALL in capsys.readouterr().err and not list(tmp_path.iterdir())
