"""Bad input a new user gave the commands and the Python API (a trial on 2026-12-06), refused before any model
work with a message that names the argument and what is allowed: mlx-lm's --kv-bits on kvq serve, a bits budget far
above what the method stores, negative seconds, an answer of no tokens, a cache setting inside a method string, a
relative path taken for a Hub id, parameter errors that did not name the method or called text a number, and an
unknown --param answered with the cache's Python names."""

from __future__ import annotations

import pytest

import kvq
from kvq.cli import main
from kvq.cli.serve_cmd import check_passed_on


def _error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"kvq {command}: error: "), err
    return err[-1]


def test_serve_refuses_mlx_lm_kv_bits_before_loading_the_model(capsys):
    """With --kv-bits mlx-lm would quantize kvq's caches once a prompt passed --quantized-kv-start (kvq refuses:
    HTTP 500 after the server started) and serve one request at a time; kvq serve names its own options instead."""
    assert main(["serve", "--method", "turboquant", "--bits", "4", "--kv-bits", "4", "--model", "/no/such/model"]) == 1
    line = _error(capsys, "serve")
    assert "--kv-bits 4: kvq serve's caches are compressed already (turboquant bits=4)" in line
    # a method string, or per-side methods, named as the cache is (the message said "None, bits default")
    for method in (["--method", "turboquant:4"], ["--key-method", "qjl", "--value-method", "affine"]):
        assert main(["serve", *method, "--kv-bits", "4", "--model", "/no/such/model"]) == 1
        err = capsys.readouterr().err
        assert ("compressed already (turboquant bits=4);" in err if len(method) == 2 else
                "compressed already (K qjl" in err and "/ V affine bits=" in err), err
    assert "use --method affine --bits 4 --param group_size=64" in line
    # the reference is mlx-lm's own server's, not a --compare option (serve has none)
    assert main(["serve", "--method", "kvcache", "--model", "/no/such/model"]) == 1
    err = capsys.readouterr().err
    assert "mlx_lm.server --model FOLDER" in err and "--compare" not in err and "--method fp16" in err
    check_passed_on(["--port", "8080", "--kv-group-size", "32"], {"method": "affine"})  # no --kv-bits: nothing to say
    with pytest.raises(ValueError, match="--param group_size=32"):
        check_passed_on(["--kv-group-size", "32", "--kv-bits=8"], {"method": "affine", "bits": 4})


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--drain-seconds", "-1"], "argument --drain-seconds: must be a finite number >= 0, not -1"),
    (["serve", "--drain-seconds", "soon"], "argument --drain-seconds: must be a number >= 0, not 'soon'"),
    (["demo", "--max-tokens", "0"], "argument --max-tokens: must be at least 1, not 0"),
    (["demo", "--max-tokens", "-1"], "argument --max-tokens: must be at least 1, not -1"),
])
def test_option_values_out_of_range_are_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_serve_help_names_the_options_it_passes_on_and_the_one_it_refuses(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--host, --port, --max-tokens" in out and "--kv-bits is refused" in out


def test_a_cache_setting_in_a_method_string_is_named_with_where_it_goes():
    """Brackets take the method's parameters and the cache's sinks, window and flush; the other cache settings
    (step, kernels, outlier_layers ...) were refused by a message that listed them as allowed."""
    from kvq.evaluation.spec import parse_method

    with pytest.raises(ValueError, match=r"outlier_layers is a setting of the cache that method strings do not carry "
                                         r"\(in brackets they take the method's parameters and the cache's sinks, "
                                         r"window, flush\); .*--param outlier_layers=VALUE"):
        parse_method("turboquant:4[outlier_layers=off]")
    assert parse_method("turboquant:4[window=16,rotation=qr]").label == "turboquant:4[window=16,rotation=qr]"


def test_a_relative_path_is_not_taken_for_a_hub_id():
    from kvq.models import ModelError, resolve_model

    for name in ("./nope", "../nope", "~/nope"):
        with pytest.raises(ModelError, match=f"model '{name}': no such file or folder.*an mlx-lm model folder"):
            resolve_model(name)


def test_parameter_errors_name_the_method_and_say_when_a_number_came_as_text():
    with pytest.raises(ValueError, match=r"^affine bits must be one of 2, 3, 4, 5, 6, 8; got 7$"):
        kvq.make_params("affine", bits=7)
    with pytest.raises(ValueError, match=r"^turboquant bits must be one of 1, 2, 3, 4; got '4'; that is text, not a "
                                         r"number \(turboquant's codes take whole bits"):
        kvq.make_params("turboquant", bits="4")
    with pytest.raises(ValueError, match=r"^turboquant_prod bits must be one of 1, 2, 3, 4; got 9"):
        kvq.make_params("turboquant_prod", bits=9)  # the variant that shares turboquant's fields is named itself


def test_method_none_names_the_sides_left_without_a_method():
    """``make_config(None)`` (the signature's ``str | None``) said "method must be one of ...; got None"; None is
    for giving each side its own method, and the message now says which side lacks one."""
    from kvq.cache import make_config

    with pytest.raises(ValueError, match=r"^method=None leaves the key_method and value_method unnamed"):
        make_config(None)
    with pytest.raises(ValueError, match=r"^method=None leaves the value_method unnamed"):
        make_config(None, key_method="qjl")
    config = make_config(None, key_method="qjl", value_method="affine")
    assert (config.key_params.method, config.value_params.method) == ("qjl", "affine")


def test_an_unknown_parameter_on_the_command_line_names_the_commands_options(capsys):
    """``kvq generate --param bitz=4`` listed the cache's settings by their Python names (``key_params``,
    ``max_kv_size (make_prompt_cache)``); the command names its own options instead, before loading a model."""
    assert main(["generate", "--method", "turboquant", "--param", "bitz=4", "--prompt", "hi",
                 "--model", "/no/such/model"]) == 1
    line = _error(capsys, "generate")
    assert "unknown parameter(s) bitz for method 'turboquant'; allowed: bits, rotation" in line
    assert line.endswith("the cache's own settings: --key-method, --value-method, --key-param, --value-param, "
                         "--sinks, --window, --kernels, --flush, --param step=..., --param outlier_layers=...")
    from kvq.cache import UnknownParameterError, make_config

    with pytest.raises(UnknownParameterError, match=r"allowed: bits, group_size; the cache's own settings: "
                                                    r"key_method, .*max_kv_size \(make_prompt_cache\)$") as caught:
        make_config("affine", bitz=3)  # Python's names in Python
    assert caught.value.method_message == "unknown parameter(s) bitz for method 'affine'; allowed: bits, group_size"
