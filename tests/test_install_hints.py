"""Hints for missing methods name a command that works here, and the demo never fails on a missing plugin."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvq import install_hints
from kvq.install_hints import DISTRIBUTIONS, distribution_of, install_command, method_hint

ROOT = Path(__file__).resolve().parents[1]
#: the workspace venv (``uv sync``) holds every distribution, editable from this clone
UV_HERE = f"uv pip install --python {sys.executable} --no-sources"


def test_every_listed_distribution_is_a_folder_of_this_repository_with_those_kvq_dependencies():
    for name, (folder, _, requires) in DISTRIBUTIONS.items():
        project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
        assert project["name"] == name
        names = (re.split(r"[\s\[<>=!~;@]", d, maxsplit=1)[0] for d in project["dependencies"])  # "kvq-core>=0.2"
        assert tuple(n for n in names if n.startswith("kvq-")) == requires


def test_hint_names_this_interpreter_and_the_local_folder_of_this_checkout():
    # the workspace installs kvq-core editable from this clone, so the command installs the sibling folder so too
    assert install_command("kvq-backends-turboquant") == f"{UV_HERE} -e {ROOT / 'kvq_backends_turboquant'}"
    hint = method_hint("turboquant_prod")
    assert hint == ("'turboquant_prod' comes with kvq-backends-turboquant, which is not installed here; install it "
                    f"with: {UV_HERE} -e {ROOT / 'kvq_backends_turboquant'}")
    assert distribution_of("qjl") == "kvq-backends-qjl" and distribution_of("affine") is None
    assert method_hint("affine") == "" and install_command("not-ours") == f"{UV_HERE} not-ours"


def test_hint_adds_the_folders_of_missing_kvq_dependencies_and_pip_where_pip_imports(monkeypatch):
    monkeypatch.setattr(install_hints, "_core_origin", lambda: (ROOT, False))  # a non-editable install
    monkeypatch.setattr(install_hints, "_installed", lambda name: name == "kvq-core")
    monkeypatch.setattr(install_hints, "_has_pip", lambda: True)
    folders = f"{ROOT / 'kvq_backends_turboquant'} {ROOT / 'kvq_metal'}"
    assert install_command("kvq-backends-turboquant") == (f"{UV_HERE} {folders}  "
                                                          f"(or: {sys.executable} -m pip install {folders})")
    monkeypatch.setattr(install_hints, "_has_pip", lambda: False)  # a uv venv has no pip: no pip form
    assert install_command("kvq-backends-qjl") == f"{UV_HERE} {ROOT / 'kvq_backends_qjl'} {ROOT / 'kvq_metal'}"


def test_without_a_clone_the_hint_says_how_to_get_one_and_never_names_pypi(monkeypatch):
    monkeypatch.setattr(install_hints, "_core_origin", lambda: (None, False))  # kvq-core from a wheel, say
    monkeypatch.setattr(install_hints, "_installed", lambda name: name == "kvq-core")
    hint = install_command("kvq-backends-turboquant")
    assert hint == ("kvq's packages are not on PyPI yet: clone the kvq repository into ./kvq (git clone <kvq's "
                    f"repository URL> kvq), then run: {UV_HERE} ./kvq/kvq_backends_turboquant ./kvq/kvq_metal")
    assert "pip install kvq-" not in method_hint("qjl")


def test_demo_falls_back_before_model_work_when_turboquant_is_absent():
    code = ("from kvq.cli.demo_cmd import demo_methods; *shown, note = demo_methods(); print(*shown); "
            "print(note)")
    env = {**os.environ, "KVQ_LOAD_PLUGINS": "baselines"}  # only kvq-core's own methods
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    first, note = out.split("\n", 1)
    assert first == "affine:4 affine:3"  # kvq.defaults.RECOMMENDED_CORE, THREE_BIT_CORE
    assert "kvq-backends-turboquant" in note and "uv pip install" in note and "instead" in note
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("turboquant:4 turboquant:3\n")


def test_extras_and_kernel_hints_use_the_same_commands():
    assert install_command("kvq-core", extra="plots") == f"{UV_HERE} -e '{ROOT / 'kvq_core'}[plots]'"
    assert install_command("not-ours", extra="x") == f"{UV_HERE} 'not-ours[x]'"


def _run(command, **kwargs):
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


HINT = "from kvq.install_hints import install_command; print(install_command({!r}))"
#: the distribution's files, then whether it was installed editable (False: a copy, as the hint asks for)
IMPORTED = ("import json, sys, kvq, {module}; from importlib import metadata; assert {method!r} in kvq.methods(); "
            "print(json.loads(metadata.distribution({dist!r}).read_text('direct_url.json'))"
            ".get('dir_info', {{}}).get('editable', False))")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("uv") is None, reason="uv is not on PATH")
@pytest.mark.parametrize("form, dist, method", [("uv", "kvq-backends-qjl", "qjl"),
                                                ("pip", "kvq-backends-turboquant", "turboquant")])
def test_printed_command_installs_the_plugin_in_a_fresh_environment(form, dist, method, tmp_path):
    """kvq-core alone (a copy from this clone, as README says), then the hint's command run as printed: ``uv``'s
    form in a ``uv venv`` (no pip), pip's form in one seeded with pip (both plugins: their kvq-metal folder too)."""
    from test_install_alone import CORE_EXTRA, _uv_install

    venv = tmp_path / "venv"
    _run(["uv", "venv", "--quiet", *(["--seed"] if form == "pip" else []), "--python", sys.executable, str(venv)])
    python = str(venv / "bin" / "python")
    _uv_install(python, [f"{ROOT / 'kvq_core'}{CORE_EXTRA}"])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "KVQ_LOAD_PLUGINS")}
    hint = _run([python, "-c", HINT.format(dist)], env=env, cwd=tmp_path).strip()
    uv_form, _, pip_form = hint.partition("  (or: ")
    assert uv_form.startswith(f"uv pip install --python {python} --no-sources {ROOT / dist.replace('-', '_')}")
    assert str(ROOT / "kvq_metal") in hint and "-e " not in hint
    assert bool(pip_form) == (form == "pip")
    _run(uv_form if form == "uv" else pip_form.removesuffix(")"), shell=True, env=env, cwd=tmp_path)
    module = dist.replace("-", "_")
    out = _run([python, "-c", IMPORTED.format(module=module, method=method, dist=dist)], env=env, cwd=tmp_path)
    assert out.strip() == "False"


def test_blas_hint_on_a_linux_cpu_without_openblas(monkeypatch):
    """Linux CPU users whose MLX uses its bundled reference BLAS are told how to get OpenBLAS (model runs ~25x
    faster); nothing is said where an optimised BLAS provides ``cblas_sgemm`` ahead of it, where MLX does not use
    its bundled BLAS, with KVQ_NO_BLAS_HINT=1, or off Linux. numpy's own OpenBLAS mapped in does not count."""
    import sys

    import mlx.core as mx

    from kvq.install_hints import blas_hint

    monkeypatch.delenv("KVQ_NO_BLAS_HINT", raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)
    plain = ("7f00-7f01 r-xp 0 00:00 0 /usr/lib/libc.so.6\n7f02-7f03 r-xp 0 00:00 0 /site-packages/mlx/lib/libmlx.so\n"
             "7f04-7f05 r-xp 0 00:00 0 /site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0\n"
             "7f06-7f07 r-xp 0 00:00 0 /site-packages/numpy.libs/libscipy_openblas64_-32a4b2a6.so\n")
    hint = blas_hint(plain, provider=None)
    assert hint is not None and "LD_PRELOAD=/usr/lib/" in hint and "openblas-pthread/libopenblas.so.0" in hint
    openblas = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
    assert blas_hint(plain, provider=openblas) is None
    assert blas_hint(plain, provider="/opt/intel/lib/libmkl_rt.so.2") is None
    assert blas_hint(plain, provider="/usr/lib/libblas.so.3") is not None  # a reference BLAS preloaded: still slow
    assert blas_hint(plain.replace("mlx_cpu.libs/libblas", "x/libmlx_deps"), provider=None) is None
    monkeypatch.setenv("KVQ_NO_BLAS_HINT", "1")
    assert blas_hint(plain, provider=None) is None
    monkeypatch.delenv("KVQ_NO_BLAS_HINT")
    monkeypatch.setattr(sys, "platform", "darwin")
    assert blas_hint(plain, provider=None) is None


_OPENBLAS = Path(f"/usr/lib/{platform.machine()}-linux-gnu/openblas-pthread/libopenblas.so.0")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _OPENBLAS.exists(),
                    reason="needs Linux with Debian's OpenBLAS (libopenblas0-pthread)")
def test_blas_hint_in_real_processes_with_and_without_openblas():
    """In a real process with numpy imported (as every kvq command has): the note is given without OpenBLAS
    preloaded and not with it, and :func:`kvq.install_hints.blas_provider` names the preloaded library."""
    code = ("import numpy, mlx.core; from kvq.install_hints import blas_hint, blas_provider; "
            "print(repr(blas_provider())); print(blas_hint() is not None)")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "KVQ_NO_BLAS_HINT")}
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert plain.stdout.split("\n")[:2] == ["None", "True"], plain.stdout + plain.stderr
    env["LD_PRELOAD"] = str(_OPENBLAS)
    fast = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    provider, shown = fast.stdout.split("\n")[:2]
    assert "openblas" in provider and shown == "False", fast.stdout + fast.stderr


def test_model_commands_print_the_blas_hint_before_model_work(monkeypatch, capsys, tmp_path):
    """``kvq generate`` and the other model-running commands put the note on stderr once, where their model work
    starts (a model loaded or built); a usage error prints none (a new user found it before a mistyped method),
    nor does ``kvq list``, nor a library call."""
    from kvq import install_hints
    from kvq.bench import random_model
    from kvq.cli import main

    monkeypatch.setattr(install_hints, "blas_hint", lambda: "kvq: note: the BLAS hint")
    assert main(["generate", "--prompt", "hi", "--method", "frobnicate"]) == 1
    assert "BLAS hint" not in capsys.readouterr().err
    assert main(["bench", "e2e", "--model", "random:tiny", "--contexts", "64", "--steps", "2", "--methods",
                 "fp16", "--no-progress", "--out", str(tmp_path), "--name", "hint-probe"]) == 0
    err = capsys.readouterr().err
    assert err.count("kvq: note: the BLAS hint") == 1
    main(["list"])
    assert "BLAS hint" not in capsys.readouterr().err
    install_hints.arm_blas_note(False)
    random_model.build_random_model(random_model.random_config("tiny"))
    assert "BLAS hint" not in capsys.readouterr().err


def test_import_kvq_without_mlx_backend_library_says_how_to_install_it(tmp_path):
    """kvq-core installed on Linux without [cpu] / [cuda12] / [cuda13]: MLX's import fails on libmlx.so (a new user
    got only that). ``import kvq``, and so the kvq command, fails with the reason and the install command; another
    ImportError of MLX's passes through as it is. A stand-in ``mlx`` package first on the path raises each."""
    fake = tmp_path / "mlx"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    src = str(Path(__file__).parents[1] / "kvq_core" / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), src])}
    for message, expected in (("libmlx.so: cannot open shared object file: No such file or directory",
                               "MLX's back-end library is not installed (libmlx.so: cannot open shared object"),
                              ("No module named 'mlx.core._other'", "No module named 'mlx.core._other'")):
        (fake / "core.py").write_text(f"raise ImportError({message!r})\n")
        r = subprocess.run([sys.executable, "-c", "import kvq"], capture_output=True, text=True, env=env)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 1 and last.startswith("ImportError: ") and expected in last, r.stderr[-2000:]
        if "libmlx" in message:  # the install command for the CPU's extra, from this checkout, after one traceback
            assert "[cpu] for the CPU, [cuda12] or [cuda13] for NVIDIA GPUs" in last and "kvq_core[cpu]" in last
            assert r.stderr.count("Traceback") == 1, r.stderr
