"""Hints for missing methods name a command that works here, and the demo never fails on a missing plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvq.install_hints import DISTRIBUTIONS, distribution_of, install_command, method_hint

ROOT = Path(__file__).resolve().parents[1]


def test_every_listed_distribution_is_a_folder_of_this_repository():
    for name, (folder, _) in DISTRIBUTIONS.items():
        assert f'name = "{name}"' in (ROOT / folder / "pyproject.toml").read_text()


def test_hint_names_the_local_folder_of_this_checkout():
    # the workspace installs kvq-core from this clone, so the command installs the sibling folder
    assert install_command("kvq-backends-turboquant").startswith(f"uv pip install {ROOT / 'kvq_backends_turboquant'}")
    hint = method_hint("turboquant_prod")
    assert "kvq-backends-turboquant" in hint and str(ROOT / "kvq_backends_turboquant") in hint
    assert distribution_of("qjl") == "kvq-backends-qjl" and distribution_of("affine") is None
    assert method_hint("affine") == "" and install_command("not-ours") == "pip install not-ours"


def test_demo_falls_back_before_model_work_when_turboquant_is_absent():
    code = "from kvq.cli.demo_cmd import demo_method; m, note = demo_method(); print(m['method'], m['bits']); print(note)"
    env = {**os.environ, "KVQ_LOAD_PLUGINS": "baselines"}  # only kvq-core's own methods
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    first, note = out.split("\n", 1)
    assert first == "affine 3"
    assert "kvq-backends-turboquant" in note and "uv pip install" in note and "instead" in note
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("turboquant 3\n")


def test_extras_and_kernel_hints_use_the_same_commands():
    assert install_command("kvq-core", extra="plots") == (f"uv pip install '{ROOT / 'kvq_core'}[plots]'  "
                                                          f"(or: pip install '{ROOT / 'kvq_core'}[plots]')")
    assert install_command("not-ours", extra="x") == "pip install 'not-ours[x]'"
