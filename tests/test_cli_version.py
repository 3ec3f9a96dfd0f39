"""``kvq --version`` / ``-V``: kvq's version and every installed kvq distribution, exit 0."""

from __future__ import annotations

from importlib import metadata

import pytest

import kvq
from kvq.cli import main


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_names_kvq_and_each_installed_distribution(flag, capsys):
    assert main([flag]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"kvq {kvq.__version__}"
    for dist in ("kvq-core", "kvq-backends-turboquant", "kvq-backends-qjl", "kvq-backends-vecinfer", "kvq-metal"):
        assert f"  {dist} {metadata.version(dist)}" in lines
    assert lines[-1].startswith("  mlx ")


def test_usage_mentions_version(capsys):
    assert main(["--help"]) == 0
    assert "kvq --version" in capsys.readouterr().out
