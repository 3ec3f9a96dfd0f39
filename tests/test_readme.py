"""The Python snippets of README.md, docs/usage.md and kvq_core/README.md run as written and print their results."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
#: kvq-core's own readme (its package metadata's long description)
CORE_README = README.parent / "kvq_core" / "README.md"
#: the longer notes the README links (the ``kvq.select`` snippet and the per-side cache)
USAGE = README.parent / "docs" / "usage.md"


def snippets(readme: Path = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)


def run(code: str, cwd: Path | None = None) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_select_snippet_prints_plan_bytes_and_error():
    code = next(s for s in snippets(USAGE) if "kvq.select(" in s)
    out = run(code)
    assert "attend" in out and "quantize" in out
    stored = re.search(r"16,777,216 bytes of fp16 keys and values stored in ([\d,]+); attention output error "
                       r"([\d.]+) \(relative\)", out)
    assert stored, out
    # 4-bit codes plus a 16-bit scale and bias per 64 coordinates: 4.5 bits of 16
    assert int(stored.group(1).replace(",", "")) == 16_777_216 * 4.5 / 16
    assert 0 < float(stored.group(2)) < 0.3
    # the snippet seeds MLX's generator, so the figure the README states is the one it prints (to a rounding step)
    stated = re.search(r"stored in [\d,]+; attention output error\s+([\d.]+) \(relative\)`", USAGE.read_text())
    assert stated and abs(float(stated.group(1)) - float(stored.group(2))) <= 0.001, (stated, out)


@pytest.mark.slow
def test_cache_snippet_generates_and_reports_bytes(tmp_path):
    code = next(s for s in snippets() if "kvq.make_prompt_cache(model" in s)
    # the snippet's comment says its window makes this short chat compress: so does the cache it saves and loads
    out = run(code + "\nprint('compressed', min(c.compressed_keys.length for c in cache))", cwd=tmp_path)
    assert (tmp_path / "chat.safetensors").stat().st_size > 0  # the prompt-cache file it saves and loads
    held = re.search(r"(\d+) tokens held in ([\d,]+) bytes", out)
    assert held, out
    assert len(out[: held.start()].strip()) > 0  # the answer's text came first
    assert int(held.group(1)) > 20 and int(held.group(2).replace(",", "")) > 0
    assert int(re.search(r"compressed (\d+)", out).group(1)) >= 16, out


@pytest.mark.slow
def test_core_readme_snippet_generates_with_a_compressing_cache():
    (code,) = snippets(CORE_README)
    out = run(code + "\nprint('compressed', min(c.compressed_keys.length for c in cache))")
    held = re.search(r"(\d+) tokens held in ([\d,]+) bytes", out)
    assert held and len(out[: held.start()].strip()) > 0, out
    assert int(re.search(r"compressed (\d+)", out).group(1)) >= 16, out  # its comment says it compresses


@pytest.mark.slow
def test_patch_snippet_makes_kvq_caches():
    code = next(s for s in snippets() if "kvq.patch_model(" in s)
    assert run(code).split() == ["KVQCache"]


@pytest.mark.slow
def test_usage_snippet_makes_a_cache_per_layer_with_its_own_key_and_value_methods():
    code = next(s for s in snippets(USAGE) if "key_method=" in s)
    assert re.fullmatch(r"\d+ layers of KVQCache\n", run(code))


def test_every_snippet_is_run():
    """Each snippet of the README and docs/usage.md is one a test above picks."""
    picked = ("kvq.select(", "kvq.make_prompt_cache(model", "kvq.patch_model(", "key_method=")
    for code in snippets() + snippets(USAGE):
        assert any(p in code for p in picked), code
