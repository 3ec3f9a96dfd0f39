"""Each distribution installs and imports alone: a fresh virtual environment per distribution with kvq-core, that
distribution and the workspace distributions its pyproject.toml declares (nothing else of the workspace), built
from the local folders as wheels (not editable: a file missing from a wheel shows), then a short script in it.

The script (:data:`CHECK`) loads plugins strictly (``KVQ_STRICT_PLUGINS=1``: a plugin that needs something not
installed fails instead of being skipped), lists the methods, plans ``affine``, runs ``kvq list``, and for each
method the distribution adds (``affine`` for kvq-core and kvq-metal) makes a cache for a tiny random mlx-lm llama
and runs one forward pass (a method that needs calibration is calibrated on that model first).

uv installs from its cache (``--offline``, hard links) and goes online only when the cache lacks something.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_imports import CORE, ROOT, distributions

pytestmark = pytest.mark.slow

UV = shutil.which("uv")
#: MLX's Linux wheels need a back end chosen by an extra; macOS needs none.
CORE_EXTRA = "[cpu]" if sys.platform == "linux" else ""

CHECK = r'''
import subprocess, sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import llama

import kvq

methods = kvq.methods()
assert {"fp16", "affine"} <= set(methods), methods
assert kvq.select("affine", (1, 2, 64, 64)).quantize is not None
assert "matplotlib" not in sys.modules
listing = subprocess.run([str(Path(sys.executable).parent / "kvq"), "list"], capture_output=True, text=True,
                         check=True).stdout
assert all(name in listing for name in methods), listing
print("methods:", ", ".join(sorted(methods)))

args = llama.ModelArgs.from_dict(dict(
    model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=2,
    num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=64, rope_theta=10000.0))
model = llama.Model(args)
prompt = (mx.arange(48) % 64)[None]


def calibrated(name):
    """VecInfer learns its codebooks from the model's keys and values (kvq calibrate, for a real model)."""
    from kvq_backends_vecinfer.calibrate import Options, calibrate
    from kvq_backends_vecinfer.collect import record

    settings = [methods[name].make_params(role=role) for role in ("keys", "values")]
    recording = record(model, [i % 64 for i in range(256)], seq_len=64, progress=False)
    calibrate(recording, "alone", settings, Options(iterations=2, points_per_centroid=16), progress=False)
    return {"model_id": "alone"}


for name in sorted(set(methods) - {"fp16", "affine"}) or ["affine"]:
    options = calibrated(name) if methods[name].calibrate else {}
    value_method = "affine" if methods[name].keys_only else None
    cache = kvq.make_prompt_cache(model, name, value_method=value_method, sinks=0, window=8, **options)
    logits = model(prompt, cache=cache)
    assert logits.shape == (1, 48, 64) and mx.all(mx.isfinite(logits)).item(), name
    print(name, "cache: one forward pass")
'''


def folders(package: str) -> list[str]:
    """What to install for ``package``: kvq-core with its back-end extra, the package, and the workspace
    distributions it requires (transitively), as local folders."""
    by_name = {d["name"]: p for p, d in distributions().items()}
    todo, chosen = [package], []
    while todo:
        current = todo.pop()
        if current not in chosen:
            chosen.append(current)
            todo += [by_name[n] for n in distributions()[current]["requires"] if n in by_name]
    return [f"{distributions()[p]['src'].parents[1]}{CORE_EXTRA if p == CORE else ''}" for p in chosen]


def _uv_install(python: str, requirements: list[str]) -> None:
    """Install ``requirements`` into ``python``'s environment, from uv's cache when it has everything."""
    command = [UV, "pip", "install", "--no-sources", "--python", python, *requirements]
    done = subprocess.run([*command, "--offline"], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:  # the cache lacks something: fetch it
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def _venv(tmp_path, package: str) -> tuple[str, dict]:
    """A fresh environment holding :func:`folders` ``(package)``: its interpreter, and the environment variables to
    run it with (strict plugin loading, a cache folder of its own)."""
    venv = tmp_path / "venv"
    subprocess.run([UV, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, cwd=tmp_path)
    python = str(venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python"))
    _uv_install(python, folders(package))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "KVQ_LOAD_PLUGINS")}
    env.update(KVQ_STRICT_PLUGINS="1", KVQ_CACHE_DIR=str(tmp_path / "cache"))
    return python, env


@pytest.mark.skipif(UV is None, reason="uv is not on PATH (these environments are made with uv: pip install uv)")
@pytest.mark.parametrize("package", sorted(p for p, d in distributions().items() if d["src"].parents[2] == ROOT))
def test_installs_and_imports_alone(package, tmp_path):
    python, env = _venv(tmp_path, package)
    (tmp_path / "check.py").write_text(CHECK)
    done = subprocess.run([python, "check.py"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"{package}: {done.stdout}")


INSTALLED = "from importlib import metadata as m; print(sorted(d.metadata['Name'].lower() for d in m.distributions()))"


@pytest.mark.skipif(UV is None, reason="uv is not on PATH (these environments are made with uv: pip install uv)")
def test_core_alone_has_no_tooling_extras_and_kvq_demo_names_the_one_it_needs(tmp_path):
    """Issue #50: kvq-core (with its back-end extra) installs neither gguf (its ``convert`` extra) nor matplotlib
    (``plots``); ``kvq demo``, whose default model is converted from GGUF, then fails before any download with one
    line naming the ``convert`` extra and the command that installs it, not a traceback."""
    python, env = _venv(tmp_path, CORE)
    installed = subprocess.run([python, "-c", INSTALLED], capture_output=True, text=True, check=True).stdout
    assert "kvq-core" in installed and "numpy" in installed
    assert "gguf" not in installed and "matplotlib" not in installed, installed
    kvq = str(Path(python).parent / "kvq")
    done = subprocess.run([kvq, "demo"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("kvq demo: error:")]
    assert "gguf" in error and "'convert' extra" in error and "kvq_core[convert]" in error, error
