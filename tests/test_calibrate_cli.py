"""``kvq calibrate`` finds a method's calibration through its declaration (``kvq.Method(..., calibrate=...)``), for
any installed method: the core names no plugin. VecInfer's own options and errors: tests/test_vecinfer.py."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

import kvq
from kvq.cli import calibrate_cmd, main

CALLS = []


@attrs.frozen
class ToyParams:
    method = "toy_calibrated"


def add_arguments(parser):
    parser.add_argument("--depth", type=int, default=2)


def run(model, **kwargs):
    CALLS.append((model, kwargs))
    return [Path("toy.safetensors")]


TOY = kvq.Method("toy_calibrated", ToyParams, "a method whose calibration is this test module (test)",
                 needs_calibration=True, calibrate=__name__)


@pytest.fixture
def toy(registered):
    CALLS.clear()
    return registered(TOY)


def test_a_declared_calibration_gets_the_shared_options_and_its_own(toy, capsys):
    assert main(["calibrate", "--method", "toy_calibrated", "--model", "m", "--depth", "5", "--quiet"]) == 0
    assert capsys.readouterr().out.split() == ["toy.safetensors"]
    assert CALLS == [("m", {"text": None, "text_name": None, "tokens": 4096, "seq_len": 512, "seed": 0,
                            "model_id": None, "progress": False, "depth": 5})]


def test_with_two_calibrated_methods_the_method_must_be_named(toy, capsys):
    with pytest.raises(SystemExit):
        main(["calibrate", "--model", "m"])
    assert "--method" in capsys.readouterr().err and not CALLS
    with pytest.raises(SystemExit):
        main(["calibrate", "--method", "toy_calibrated", "--help"])
    assert "--depth" in capsys.readouterr().out


def test_the_only_calibrated_method_is_the_default(toy, monkeypatch):
    monkeypatch.setattr(calibrate_cmd, "calibrated_methods", lambda: {"toy_calibrated": TOY})
    assert main(["calibrate", "--quiet"]) == 0
    assert CALLS[0][0] is None and CALLS[0][1]["depth"] == 2


def test_a_calibration_that_does_not_import_is_named(registered, capsys):
    registered(kvq.Method("toy_calibrated", ToyParams, "(test)", calibrate="kvq_no_such_module.calibrate"))
    assert main(["calibrate", "--method", "toy_calibrated"]) == 1
    err = capsys.readouterr().err
    assert ("calibrating 'toy_calibrated': kvq_no_such_module.calibrate (declared by kvq.register) does not "
            "import") in err


def test_no_calibrated_method_installed(monkeypatch, capsys):
    monkeypatch.setattr(calibrate_cmd, "calibrated_methods", dict)
    assert main(["calibrate"]) == 1
    err = capsys.readouterr().err
    # the install command of kvq's own calibrated method, not only words for plugin authors (a new user's case)
    assert "no installed method declares a calibration" in err and "kvq-backends-vecinfer" in err


@pytest.mark.parametrize("option, message", [(["--iterations", "0"], "iterations must be >= 1"),
                                             (["--smooth-alpha", "-1"], r"smooth_alpha must be in \[0, 1\]")])
def test_vecinfer_calibration_refuses_settings_that_calibrate_nothing(option, message, capsys, no_model_work):
    """--iterations 0 and a negative smoothing exponent ran and overwrote a good calibration; now refused before
    the model is loaded."""
    assert main(["calibrate", "--method", "vecinfer", *option]) == 1
    assert re.search(message, capsys.readouterr().err)

