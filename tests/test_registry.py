"""Plugin contract: hook validation, guarded entry-point discovery, strict mode, the example plugin."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from importlib.metadata import EntryPoint
from pathlib import Path

import pluggy
import pytest

import kvq
from kvq import plugins as registry_mod
from kvq.baselines.affine import AffineMLX

ROOT = Path(__file__).resolve().parents[1]


class BadSignature(AffineMLX):
    """An affine copy whose quantize hook takes an argument the spec does not have."""

    backend = "bad"

    def kvq_quantize(self, x, params, temperature):
        raise AssertionError("never called")


class Misspelled(AffineMLX):
    backend = "typo"

    def kvq_quantise(self, x, params):
        raise AssertionError("never called")


class NoOps:
    method, backend = "affine", "empty"

    def supports(self, problem):
        return True

    def cost(self, problem):
        return 0.0


def test_builtin_methods_come_through_the_entry_point():
    reg = kvq.registry()
    assert {"fp16", "affine"} <= set(reg.methods)
    assert reg.origin["affine"] == "plugin 'baselines'"
    assert reg.origin[("affine", "mlx")] == "plugin 'baselines'"


def test_wrong_hook_signature_is_rejected_with_the_argument_named():
    with pytest.raises(pluggy.PluginValidationError, match="temperature"):
        kvq.register(BadSignature())
    assert ("affine", "bad") not in kvq.registry().implementations


def test_a_hook_or_supports_missing_an_argument_is_rejected_at_registration():
    """pluggy refuses arguments a spec lacks, not missing ones; kvq calls every argument, so a hook without one
    (a new user's ``kvq_quantize(self, x)``, which registered and failed at the cache's first compression) and a
    ``supports`` that wants more than the problem are refused when registered, naming what is missing."""
    from kvq.baselines import fp16

    class FewerArgs(fp16.Fp16MLX):
        method, backend = "fp16", "fewer"

        def kvq_quantize(self, x):
            return None

    class KeywordOnly(fp16.Fp16MLX):
        method, backend = "fp16", "kwonly"

        def kvq_quantize(self, x, *, params):
            return None

    with pytest.raises(kvq.RegistrationError, match=r"kvq_quantize\(x, params\) lacks the argument\(s\) params"):
        kvq.register(KeywordOnly())  # kvq passes params positionally

    class WideSupports(fp16.Fp16MLX):
        method, backend = "fp16", "wide"

        def supports(self, problem, extra):
            return True

    with pytest.raises(kvq.RegistrationError, match=r"kvq_quantize\(x\) lacks the argument\(s\) params; kvq "
                                                    r"calls it as kvq_quantize\(x, params\)"):
        kvq.register(FewerArgs())
    with pytest.raises(kvq.RegistrationError, match=r"supports must take one argument, the problem"):
        kvq.register(WideSupports())
    assert not {("fp16", "fewer"), ("fp16", "wide")} & set(kvq.registry().implementations)


def test_a_plugin_module_registers_as_its_entry_point_would():
    """``kvq.register(module)`` for a plugin that is not installed: everything its ``kvq_register`` hands over, all
    or nothing, and ``kvq.unregister(module)`` takes it all back (a new user's ``kvq.register(myint8)`` was
    refused as an implementation without a ``method``)."""
    import types

    from kvq.baselines import fp16

    class Twin(fp16.Fp16MLX):
        backend = "twin"

    class Bad(fp16.Fp16MLX):
        backend = "bad"

        def kvq_dequantize(self, encoded):
            return None

    good, broken = types.ModuleType("good_module"), types.ModuleType("broken_module")
    good.kvq_register = lambda register: register(Twin())
    broken.kvq_register = lambda register: (register(Twin()), register(Bad()))
    assert kvq.register(good) is good and ("fp16", "twin") in kvq.registry().implementations
    with pytest.raises(kvq.RegistrationError, match="plugin module:good_module is already registered"):
        kvq.register(good)  # refused before anything changes: the first registration stays whole
    assert ("fp16", "twin") in kvq.registry().implementations
    kvq.unregister(good)
    assert ("fp16", "twin") not in kvq.registry().implementations
    with pytest.raises(kvq.RegistrationError, match="lacks the argument"):
        kvq.register(broken)
    assert ("fp16", "twin") not in kvq.registry().implementations  # rolled back with the failure
    with pytest.raises(kvq.RegistrationError, match="no_hooks has no kvq_register"):
        kvq.register(types.ModuleType("no_hooks"))


def test_unknown_hook_name_is_rejected_with_a_suggestion():
    with pytest.raises(kvq.RegistrationError, match="kvq_quantise.*did you mean kvq_quantize"):
        kvq.register(Misspelled())


def test_object_without_op_hooks_is_rejected():
    with pytest.raises(kvq.RegistrationError, match="implements none of the op hooks"):
        kvq.register(NoOps())


def test_duplicate_registration_names_the_owner():
    with pytest.raises(kvq.RegistrationError, match="affine:mlx is already registered by plugin 'baselines'"):
        kvq.register(AffineMLX())


def _fake_entry_points(tmp_path, monkeypatch, modules: dict[str, str]):
    """Write modules to tmp_path and make them the only entry points of group kvq."""
    for name, source in modules.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [EntryPoint(name, name, "kvq") for name in modules]
    monkeypatch.setattr(registry_mod, "entry_points", lambda group: eps if group == "kvq" else [])


GOOD = """
    from kvq.baselines import fp16
    class Twin(fp16.Fp16MLX):
        backend = "twin"
    def kvq_register(register):
        register(Twin())
"""
BROKEN_IMPORT = "import module_that_does_not_exist\n"
BAD_HOOK = """
    from kvq.baselines import fp16
    from kvq.declaration import Method
    class P:
        method = "half"
    class Bad(fp16.Fp16MLX):
        method, backend = "half", "mlx"
        def kvq_dequantize(self, encoded, dtype, extra):
            pass
    def kvq_register(register):
        register(Method("half", P, "registered before the bad implementation; must be rolled back"))
        register(Bad())
"""


def test_broken_plugins_are_skipped_with_a_warning_naming_them(tmp_path, monkeypatch):
    _fake_entry_points(tmp_path, monkeypatch, {"good_plugin": GOOD, "broken_import": BROKEN_IMPORT,
                                               "bad_hook": BAD_HOOK})
    reg = registry_mod.Registry()
    with pytest.warns(kvq.PluginLoadWarning) as caught:
        reg.load_entry_points(strict=False)
    messages = " | ".join(str(w.message) for w in caught)
    assert "'broken_import'" in messages and "ModuleNotFoundError" in messages
    assert "'bad_hook'" in messages and "extra" in messages
    assert ("fp16", "twin") in reg.implementations  # the good one still loads
    assert "half" not in reg.methods  # everything the failed plugin registered is rolled back
    assert set(reg.failures) == {"broken_import", "bad_hook"}


def test_strict_mode_raises(tmp_path, monkeypatch):
    _fake_entry_points(tmp_path, monkeypatch, {"broken_import": BROKEN_IMPORT})
    monkeypatch.setenv("KVQ_STRICT_PLUGINS", "1")
    with pytest.raises(kvq.RegistrationError, match="broken_import") as caught:
        registry_mod.Registry().load_entry_points()
    # the command stops: the message says so, not that the plugin "was skipped"
    assert "failed to load, and strict plugin loading is on (KVQ_STRICT_PLUGINS)" in str(caught.value)
    assert "skipped" not in str(caught.value) and "ModuleNotFoundError" in str(caught.value)


def test_unknown_method_of_an_absent_first_party_plugin_names_the_install_command():
    reg = registry_mod.Registry()
    reg.loaded = True  # no entry points: as an install of kvq-core alone
    reg.register(kvq.baselines.affine.METHOD)
    with pytest.raises(ValueError, match=r"method must be one of affine; got 'qjl' \('qjl' comes with "
                                         r"kvq-backends-qjl, which is not installed here; install it with: uv pip "
                                         rf"install --python {re.escape(sys.executable)} --no-sources "):
        reg.method("qjl")
    with pytest.raises(ValueError, match=r"got 'nope'$"):  # no hint for a method kvq does not ship
        reg.method("nope")


def test_the_command_lines_method_strings_make_the_configs_they_spell():
    """``make_prompt_cache(model, "turboquant:3")``, the CLI's spelling (a new user tried it), makes the cache the
    keywords make; a keyword that sets what the string sets otherwise, or mlx-lm's own caches, are refused by name."""
    from kvq.cache import make_config

    same = [("turboquant:3", dict(method="turboquant", bits=3)),
            ("turboquant:3.5", dict(method="turboquant", bits=3.5)),
            ("affine:k8v4", dict(method="affine", key_params={"bits": 8}, value_params={"bits": 4})),
            ("qjl[sketch_dim=64]+affine:4", dict(key_method="qjl", value_method="affine",
                                                 key_params={"sketch_dim": 64}, value_params={"bits": 4})),
            ("turboquant:4[flush=64,window=32]", dict(method="turboquant", bits=4, flush=64, window=32)),
            ("kvq-fp16", dict(method="fp16")), (" kvq-fp16 ", dict(method="fp16"))]
    for string, kwargs in same:
        assert make_config(string) == make_config(**kwargs), string
    # keywords beside the string: what it leaves unset, or the same value
    assert make_config("turboquant:4", sinks=0, kernels="off") == make_config("turboquant", bits=4, sinks=0,
                                                                              kernels="off")
    assert make_config("affine:4[window=64]", window=64).window == 64
    assert make_config("affine:4", bits=4) == make_config("affine", bits=4)  # repeated, not contradicted
    for string, kwargs, match in [
            ("turboquant:3", dict(bits=4), r"method 'turboquant:3' sets bits=3; got bits=4 as well \(give the "
                                           r"method's name, 'turboquant', to set it by keyword\)"),
            ("turboquant:3", dict(key_params={"bits": 2}), r"sets bits=3; got bits=2"),
            ("turboquant:3.5", dict(bits=3), r"method 'turboquant:3.5' sets bits=3.5; got bits=3"),
            ("turboquant:3.5", dict(key_params={"bits": 2}), r"bits=3.5 is a budget for keys and values together"),
            ("affine:4[window=64]", dict(window=32), r"sets window=64; got window=32 as well"),
            ("mlx-affine", {}, r"method 'mlx-affine' is one of mlx-lm's own caches"),
            ("turboquant:3", dict(key_method="affine"), r"names the methods already; give key_method with"),
            ("kvcache", {}, r"method 'kvcache' is one of mlx-lm's own caches, not a kvq cache"),
            ("mlx-affine:4", {}, r"method 'mlx-affine:4' is one of mlx-lm's own caches"),
            ("affine:4+mlx-affine:4", {}, r"mlx-affine is mlx-lm's cache for keys and values together"),
            ("turboquant:x", {}, r"bits 'x' must be an integer"),
            ("nope:3", {}, r"got 'nope'$")]:
        with pytest.raises(ValueError, match=match):
            make_config(string, **kwargs)


def test_load_plugins_env_limits_discovery(tmp_path, monkeypatch):
    _fake_entry_points(tmp_path, monkeypatch, {"good_plugin": GOOD, "broken_import": BROKEN_IMPORT})
    monkeypatch.setenv("KVQ_LOAD_PLUGINS", "good_plugin")
    reg = registry_mod.Registry()
    reg.load_entry_points()
    assert ("fp16", "twin") in reg.implementations and not reg.failures
    assert reg.not_loaded == {"broken_import"}  # kvq list shows it as "not loaded (KVQ_LOAD_PLUGINS)"


def test_load_plugins_env_keeps_kvq_cores_own_methods(monkeypatch):
    """KVQ_LOAD_PLUGINS naming a third-party plugin still loads kvq-core's fp16 and affine (a new user's
    ``KVQ_LOAD_PLUGINS=myint8 kvq generate`` failed after its answer: "method must be one of myint8; got 'fp16'");
    the other entry points are left out."""
    monkeypatch.setenv("KVQ_LOAD_PLUGINS", "nobody_installed_this")
    reg = registry_mod.Registry()
    reg.load_entry_points()
    assert {"fp16", "affine"} <= set(reg.methods) and "turboquant" not in reg.methods
    assert {"metal", "turboquant"} <= reg.not_loaded and "baselines" not in reg.not_loaded


def _install_example(target: Path) -> None:
    source = ROOT / "examples" / "kvq-example-plugin"
    uv = ["uv", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(source)]
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(source)]
    try:
        subprocess.run(uv, check=True, capture_output=True, text=True)
    except (FileNotFoundError, subprocess.CalledProcessError):
        subprocess.run(pip, check=True, capture_output=True, text=True)


def test_example_plugin_is_installed_discovered_and_selected(tmp_path):
    _install_example(tmp_path / "site")
    script = textwrap.dedent("""
        import json, kvq, mlx.core as mx
        plan = kvq.select("absmax8", (1, 2, 64, 32))
        x = mx.random.normal((1, 2, 64, 32))
        enc = plan.quantize(x, plan.params)
        err = float(mx.abs(plan.dequantize(enc, mx.float32) - x).max())
        print(json.dumps({"origin": kvq.registry().origin["absmax8"], "backend": plan.choices["quantize"].backend,
                          "attend": plan.attend is None, "err": err,
                          "bits": plan.params.accounting(32).bits_per_coordinate}))
    """)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    out = subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True)
    import json
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["origin"] == "plugin 'absmax8'"
    assert result["backend"] == "mlx" and result["attend"]
    assert result["err"] < 4.5 / 127  # half a step of the largest |x| (about 4 for 64x32 N(0,1) draws)
    assert result["bits"] == 8.5  # 8-bit codes + one fp16 scale per 32 coordinates
