"""What the docs and ``kvq list`` say a method accepts is what it accepts (a user read 'bits 2-8' and got
``bits=7`` refused)."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import pytest

import kvq

README = Path(__file__).resolve().parents[1] / "README.md"


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
