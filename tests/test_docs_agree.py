"""What the docs and ``kvq list`` say a method accepts is what it accepts (a user read 'bits 2-8' and got
``bits=7`` refused)."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import pytest

import kvq

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _accepted_affine_bits() -> list[int]:
    ok = []
    for bits in range(1, 9):
        try:
            kvq.make_params("affine", bits=bits)
        except ValueError:
            continue
        ok.append(bits)
    return ok


def _quantize_bits() -> list[int]:
    """The widths ``mx.quantize`` (affine's quantizer) takes, probed."""
    ok = []
    for bits in range(1, 9):
        try:
            mx.eval(mx.quantize(mx.ones((1, 64)), group_size=64, bits=bits))
        except (ValueError, RuntimeError):
            continue
        ok.append(bits)
    return ok


def test_affine_bits_agree_with_mx_quantize_list_and_readme():
    accepted = _accepted_affine_bits()
    # every width mx.quantize takes, less 1 bit (two levels per group: kvq leaves it out on purpose)
    assert accepted == [b for b in _quantize_bits() if b >= 2]
    listed = ", ".join(map(str, accepted))
    assert f"bits {listed}" in kvq.methods()["affine"].description
    row = next(line for line in README.read_text().splitlines() if line.startswith("| `affine` ("))
    assert re.match(rf"\| `affine` \(bits {re.escape(listed)};", row), row


@pytest.mark.parametrize("bits", [1, 7])
def test_affine_refuses_widths_mx_quantize_lacks_by_name(bits):
    with pytest.raises(ValueError, match=r"bits must be one of 2, 3, 4, 5, 6, 8; got " + str(bits)):
        kvq.make_params("affine", bits=bits)


def test_architecture_paths_are_exact_from_the_repository_root():
    """docs/ARCHITECTURE.md says its paths are relative to the repository root: every code-quoted path of two or
    more parts (``kvq_metal/src/kvq_metal/dialect.py``, not ``kvq_metal/dialect.py``) exists there."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    paths = {t for t in re.findall(r"`([^`\s<>]+)`", text) if "/" in t.rstrip("/").strip("/")}
    assert len(paths) > 20 and not [p for p in sorted(paths) if not (ROOT / p).exists()]


def test_the_readme_recommends_what_kvq_defaults_names_and_shows_the_demos_questions():
    """The README's "Which to use" names :data:`kvq.defaults.RECOMMENDED` (the one place it is defined), its ~3-bit
    and kvq-core-alone caches; its demo output asks the demo's questions of the demo's caches."""
    from kvq.cli.demo_cmd import QUESTIONS
    from kvq.defaults import RECOMMENDED, RECOMMENDED_CORE, THREE_BIT

    text = README.read_text()
    which = re.search(r"Which to use \(`kvq.defaults.RECOMMENDED`\):\s+`([^`]+)`.*?`([^`]+)` for a ~3-bit cache,\s+"
                      r"`([^`]+)` with\s+`kvq-core` alone", text, re.S)
    assert which and which.groups() == (RECOMMENDED, THREE_BIT, RECOMMENDED_CORE)
    shown = text.split("```text\nkvq demo:")[1].split("```")[0]
    assert all(f"Q{i + 1}. {q}" in shown for i, q in enumerate(QUESTIONS))
    assert all(f"\n{label} " in shown for label in ("kvcache (float32)", RECOMMENDED, THREE_BIT))


def test_the_readme_lists_the_random_shapes_bench_takes():
    """The README's list of random-weight shapes is ``kvq.bench.random_model.PRESETS`` (a user offline has only
    these for ``kvq bench`` and ``kvq fit``)."""
    from kvq.bench.random_model import PREFIX, PRESETS

    text = README.read_text()
    listed = set(re.findall(r"`(random:[\w.-]+)`", text))
    assert listed == {PREFIX + name for name in PRESETS}
