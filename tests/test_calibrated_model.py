"""Methods whose parameters name a model's calibration (#24 item 2).

kvq's commands that run a model (generate, serve, eval, bench) name the calibration after ``--model``, as
``kvq calibrate --model`` names it (the method's calibration module's ``model_id_for``), and refuse a missing one
before loading the model with the command to run, the model spelled as given; ``kvq.select`` reports parameters
that are not ready (``check_ready``: kvq.contract.ChecksReady) in its plan, whose ``quantize`` then raises the
same error up front. A toy method shows the core names no plugin; then VecInfer's own path.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import ClassVar

import attrs
import mlx.core as mx
import numpy as np
import pytest

from conftest import config_folder

import kvq
from kvq.cli import bench_cmd, eval_cmd, generate_cmd, main

CALIBRATED: set[str] = set()


def model_id_for(model):
    """This module is the toy's calibration module: how it names a model's calibration."""
    return "toy-default" if model is None else Path(model).name


@attrs.frozen
class ToyParams:
    method: ClassVar[str] = "toy_per_model"
    model_id: str | None = None

    def accounting(self, head_dim):
        return kvq.BitsAccounting(head_dim, {"x": 16 * head_dim})

    def check_head_dim(self, head_dim):
        pass

    def check_ready(self):
        if self.model_id is None:
            raise ValueError("toy_per_model needs a calibrated model: pass model_id=<the model>")
        if self.model_id not in CALIBRATED:
            raise ValueError(f"no toy calibration of {self.model_id!r}; run: kvq calibrate --model {self.model_id}")


class ToyMLX:
    method, backend = "toy_per_model", "mlx"

    def supports(self, problem):
        return True

    def cost(self, problem):
        return 1.0

    def kvq_quantize(self, x, params):
        return kvq.Encoded(params, {"x": x}, x.shape[-1])

    def kvq_dequantize(self, encoded, dtype):
        return encoded.data["x"].astype(dtype)


@pytest.fixture
def toy(registered):
    CALIBRATED.clear()
    registered(kvq.Method("toy_per_model", ToyParams, "(test)", needs_calibration=True, calibrate=__name__), ToyMLX())
    yield
    CALIBRATED.clear()


@pytest.fixture
def model_folder(tmp_path):
    """A llama config without weights (nothing may load it) in a folder named ``my-model``."""
    return config_folder(tmp_path / "my-model", num_key_value_heads=2)


# -- kvq.select ------------------------------------------------------------------------------------------
def test_select_says_what_is_missing_and_quantize_raises_it_up_front(toy):
    plan = kvq.select("toy_per_model", (1, 2, 16, 64))
    assert not plan.ready and "needs a calibrated model" in str(plan.not_ready)
    assert "NOT READY: toy_per_model needs a calibrated model: pass model_id=<the model>" in plan.explain()
    assert plan.to_dict()["not_ready"] == str(plan.not_ready)
    with pytest.raises(ValueError, match="pass model_id"):
        plan.quantize(mx.zeros((1, 2, 16, 64)), plan.params)
    assert plan.dequantize is not None  # what needs no calibration is served


def test_a_calibration_made_after_an_unready_plan_is_seen(toy):
    params = ToyParams(model_id="m")
    assert not kvq.select("toy_per_model", (1, 2, 16, 64), params=params).ready
    CALIBRATED.add("m")
    plan = kvq.select("toy_per_model", (1, 2, 16, 64), params=params)
    assert plan.ready and "NOT READY" not in plan.explain()
    assert kvq.select("toy_per_model", (1, 2, 16, 64), params=params) is plan  # ready plans are cached


# -- the commands that run a model -------------------------------------------------------------------------
def _generate_args(*argv):
    return generate_cmd.build_parser().parse_args([*argv, "--prompt", "hi"])


def test_generate_and_serve_name_the_calibration_after_the_model(toy, model_folder):
    CALIBRATED.update({"my-model", "toy-default", "other"})
    options = generate_cmd.cache_options(_generate_args("--model", str(model_folder), "--method", "toy_per_model"))
    config = kvq.cache.make_config(**options)
    assert config.key_params.model_id == config.value_params.model_id == "my-model"
    default = generate_cmd.cache_options(_generate_args("--method", "toy_per_model"))
    assert kvq.cache.make_config(**default).key_params.model_id == "toy-default"
    # a model id given is kept; per side, and in method strings too
    given = generate_cmd.cache_options(_generate_args("--model", str(model_folder), "--method", "toy_per_model",
                                                      "--param", "model_id=other"))
    assert kvq.cache.make_config(**given).key_params.model_id == "other"
    mixed = generate_cmd.cache_options(_generate_args("--model", str(model_folder), "--method", "fp16",
                                                      "--key-method", "toy_per_model"))
    config = kvq.cache.make_config(**mixed)
    assert (config.key_params.model_id, config.value_params.method) == ("my-model", "fp16")
    spec = generate_cmd.cache_options(_generate_args("--model", str(model_folder), "--method", "toy_per_model+fp16"))
    assert kvq.cache.make_config(**spec).key_params.model_id == "my-model"


def test_a_missing_calibration_fails_before_the_model_loads_with_the_command_to_run(toy, model_folder, capsys,
                                                                                     monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("model work started before the input was checked")

    monkeypatch.setattr(kvq.distributed, "load", refuse)
    assert main(["generate", "--model", str(model_folder), "--method", "toy_per_model", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err.strip()
    # the id is the folder's name, but kvq calibrate needs the folder: the command names it as given
    assert err == f"kvq generate: error: no toy calibration of 'my-model'; run: kvq calibrate --model {model_folder}"


def test_eval_names_the_calibration_after_the_model(toy, model_folder, capsys):
    args = eval_cmd.parser().parse_args(["--model", str(model_folder), "--methods", "toy_per_model,fp16",
                                         "--context", "512"])
    with pytest.raises(ValueError, match=rf"method 'toy_per_model': no toy calibration of 'my-model'; run: kvq "
                                         rf"calibrate --model {model_folder}$"):
        eval_cmd.check(args)
    CALIBRATED.add("my-model")
    specs = eval_cmd.check(args)[0]
    assert [(s.label, s.key_params, s.value_params) for s in specs] == [
        ("kvcache", {}, {}), ("toy_per_model", {"model_id": "my-model"}, {"model_id": "my-model"})]


def test_bench_names_the_calibration_after_the_model_and_asks_for_one_on_random_models(toy, model_folder):
    CALIBRATED.add("my-model")
    args = bench_cmd.e2e_parser().parse_args(["--model", str(model_folder), "--methods", "toy_per_model"])
    specs = bench_cmd.e2e_check(args)["specs"]
    assert specs[-1].key_params == {"model_id": "my-model"}
    args = bench_cmd.e2e_parser().parse_args(["--model", "random:tiny", "--methods", "toy_per_model"])
    with pytest.raises(ValueError, match=r"toy_per_model uses a model's calibration and random:tiny has none: "
                                         r"write toy_per_model\[model_id=M\]"):
        bench_cmd.e2e_check(args)
    args = bench_cmd.e2e_parser().parse_args(["--model", "random:tiny", "--methods", "toy_per_model[model_id=my-model]"])
    assert bench_cmd.e2e_check(args)["specs"][-1].key_params == {"model_id": "my-model"}


# -- VecInfer --------------------------------------------------------------------------------------------
@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    from kvq_backends_vecinfer import storage

    monkeypatch.setenv("KVQ_DATA_DIR", str(tmp_path / "kvq-data"))
    storage.forget()
    yield tmp_path / "kvq-data"
    storage.forget()


def _calibrate(model_id, layers=2, heads=1, head_dim=64):
    """A fast synthetic calibration (default settings: sub_dim 4, code_bits 8) of a model of these shapes."""
    from kvq_backends_vecinfer.calibrate import Options, calibrate
    from kvq_backends_vecinfer.collect import Recording
    from kvq_backends_vecinfer.params import VecInferParams

    rng = np.random.default_rng(0)
    data = [[mx.array(rng.standard_normal((heads, 512, head_dim)).astype(np.float32)) for _ in range(layers)]
            for _ in range(2)]
    settings = [VecInferParams(role=role) for role in ("keys", "values")]
    calibrate(Recording(*data, tuple(range(layers))), model_id, settings,
              Options(iterations=2, points_per_centroid=2), progress=False)


def test_vecinfer_in_python_says_model_id_in_python_syntax(data_dir):
    from kvq_backends_vecinfer.storage import CalibrationError

    plan = kvq.select("vecinfer", (1, 2, 64, 64))
    assert "NOT READY: vecinfer needs a calibrated model: pass model_id=<the model>" in plan.explain()
    assert "kvq.make_prompt_cache(model, 'vecinfer', model_id='SmolLM2-135M-Instruct')" in plan.explain()
    assert "--param" not in plan.explain()
    with pytest.raises(CalibrationError, match="pass model_id=") as info:
        plan.quantize(mx.zeros((1, 2, 64, 64)), plan.params)
    assert Path(traceback.extract_tb(info.tb)[-1].filename).name == "selection.py"  # raised up front, not in storage


def test_vecinfer_model_id_as_a_path_says_what_it_is_stored_under(data_dir, model_folder):
    from kvq_backends_vecinfer.params import VecInferParams
    from kvq_backends_vecinfer.storage import CalibrationError, model_id_for

    assert model_id_for(str(model_folder)) == "my-model" and model_id_for(None) == "SmolLM2-135M-Instruct"
    with pytest.raises(CalibrationError, match="model_id is the name it is stored under: 'my-model'"):
        VecInferParams(model_id=str(model_folder)).check_ready()


def test_vecinfer_generate_uses_the_calibration_of_model(data_dir, model_folder):
    args = _generate_args("--model", str(model_folder), "--method", "vecinfer")
    with pytest.raises(ValueError, match=rf"no vecinfer calibration for model 'my-model' .* run: kvq calibrate "
                                         rf"--model {model_folder} --sub-dim 4 --code-bits 8$"):
        generate_cmd.cache_options(args)
    _calibrate("my-model")
    config = kvq.cache.make_config(**generate_cmd.cache_options(args))
    assert (config.key_params.model_id, config.value_params.model_id) == ("my-model", "my-model")
    # one label for both sides: each side's role is that side's default (a new user saw a 100-character heading)
    assert generate_cmd.cache_label(generate_cmd.cache_options(args)) == "vecinfer model_id=my-model"


@pytest.mark.slow
def test_vecinfer_generate_after_calibrating_the_default_model(data_dir, capsys):
    """#24's report: after 'kvq calibrate' of the default model, 'kvq generate --method vecinfer' runs (a synthetic
    calibration of the default model's shapes stands in for the real one, which takes minutes)."""
    from kvq import models

    config = json.loads((models.default_model_path(progress=False) / "config.json").read_text())
    _calibrate("SmolLM2-135M-Instruct", config["num_hidden_layers"], config["num_key_value_heads"],
               config["hidden_size"] // config["num_attention_heads"])
    assert main(["generate", "--method", "vecinfer", "--prompt", "Why is the sky blue?", "--max-tokens", "4",
                 "--sinks", "0", "--window", "0"]) == 0
    out = capsys.readouterr().out
    assert "vecinfer model_id=SmolLM2-135M-Instruct" in out and "bits/coordinate (K / V)" in out


def test_kvq_select_names_the_command_line_form_for_a_missing_calibration(capsys):
    """``kvq select`` prints the plan's Python-worded reason and the form its own options take."""
    from kvq.cli import main

    assert main(["select", "vecinfer", "--shape", "1,2,64,64"]) == 0
    out = capsys.readouterr().out
    assert "NOT READY" in out
    assert "kvq select vecinfer --shape 1,2,64,64 --param model_id=<the model>" in out
