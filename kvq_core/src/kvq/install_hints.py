"""Install commands for kvq's own distributions, worded for how this kvq was installed.

The core imports no plugin; it only knows which of kvq's own distributions provides which method, so that an
error about a missing method can say what to install. The command works as printed, in any shell and without an
activated environment: it names this interpreter (``uv pip install --python <sys.executable>``), passes
``--no-sources`` (inside a clone, uv would otherwise read the workspace's ``[tool.uv.sources]`` and install
kvq-core and kvq-metal as editable copies of the clone) and lists the folders of the distribution's kvq
dependencies that are not installed here (they are not on PyPI, so no resolver can find them by name). A pip form
(``<sys.executable> -m pip install ...``) follows only where pip imports in this interpreter (a ``uv venv`` has no
pip). When ``kvq-core`` came from a local folder (a clone of the kvq repository), the folders are that clone's, and
editable when kvq-core is; otherwise the command says how to get a clone. Third-party plugins are not listed:
their own documentation says how to install them.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shlex
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

#: kvq's own distributions: name -> (folder in the repository, methods it provides, the kvq distributions its
#: pyproject.toml requires; tests/test_install_hints.py checks these against the folders).
DISTRIBUTIONS = {
    "kvq-core": ("kvq_core", (), ()),
    "kvq-backends-turboquant": ("kvq_backends_turboquant", ("turboquant", "turboquant_prod", "turboquant_rvq"),
                                ("kvq-core", "kvq-metal")),
    "kvq-backends-qjl": ("kvq_backends_qjl", ("qjl",), ("kvq-core", "kvq-metal")),
    "kvq-backends-vecinfer": ("kvq_backends_vecinfer", ("vecinfer",), ("kvq-core", "kvq-metal")),
    "kvq-metal": ("kvq_metal", (), ("kvq-core",)),
}


@lru_cache(maxsize=1)
def _core_origin() -> tuple[Path | None, bool]:
    """The local folder ``kvq-core`` was installed from (``direct_url.json`` of its metadata: its parent is the
    clone), or ``None``; and whether that install is editable."""
    try:
        text = metadata.distribution("kvq-core").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None, False
    if not text:
        return None, False
    info = json.loads(text)
    url = urlparse(info.get("url", ""))
    if url.scheme != "file":
        return None, False
    return Path(unquote(url.path)).parent, bool(info.get("dir_info", {}).get("editable"))


def _installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def _to_install(distribution: str) -> list[str]:
    """``distribution`` and the kvq distributions it needs (transitively) that are not installed here."""
    chosen, todo = [distribution], list(DISTRIBUTIONS[distribution][2])
    while todo:
        name = todo.pop(0)
        if name not in chosen and not _installed(name):
            chosen.append(name)
            todo += DISTRIBUTIONS[name][2]
    return chosen


def _has_pip() -> bool:
    return importlib.util.find_spec("pip") is not None


def _commands(targets: list[str]) -> str:
    """uv's command for ``targets`` (quoted for a POSIX shell) into this interpreter, and pip's where pip imports."""
    python = shlex.quote(sys.executable)
    args = " ".join(targets)
    uv = f"uv pip install --python {python} --no-sources {args}"
    return f"{uv}  (or: {python} -m pip install {args})" if _has_pip() else uv


def install_command(distribution: str, extra: str | None = None) -> str:
    """A command that installs ``distribution`` (one of :data:`DISTRIBUTIONS`, or any PyPI name), with an optional
    extra (``"plots"``), into this interpreter's environment: for kvq's own distributions the folders of the
    clone kvq-core came from (the distribution's and those of its kvq dependencies not installed here), else how
    to get a clone (kvq is not on PyPI yet); any other name from PyPI."""
    suffix = f"[{extra}]" if extra else ""
    if distribution not in DISTRIBUTIONS:
        return _commands([shlex.quote(distribution + suffix)])
    folders = [DISTRIBUTIONS[name][0] + (suffix if name == distribution else "") for name in _to_install(distribution)]
    root, editable = _core_origin()
    if root is not None and (root / DISTRIBUTIONS[distribution][0] / "pyproject.toml").is_file():
        return _commands([("-e " if editable else "") + shlex.quote(str(root / f)) for f in folders])
    clone = _commands([shlex.quote(f"./kvq/{f}") for f in folders])
    return (f"kvq's packages are not on PyPI yet: clone the kvq repository into ./kvq "
            f"(git clone <kvq's repository URL> kvq), then run: {clone}")


def missing_backend_text(exc: ImportError) -> str:
    """Why ``import kvq`` failed where importing MLX fails for want of its back-end library (``libmlx.so``: on
    Linux, kvq-core installed without one of the extras that bring it), and the command that installs it."""
    return (f"MLX's back-end library is not installed ({exc}). On Linux kvq-core takes it as an extra: [cpu] for "
            f"the CPU, [cuda12] or [cuda13] for NVIDIA GPUs; for the CPU: {install_command('kvq-core', 'cpu')}")


def distribution_of(method: str) -> str | None:
    """The kvq distribution that provides ``method``, or ``None`` (a core method, or one kvq does not ship)."""
    return next((name for name, (_, methods, _) in DISTRIBUTIONS.items() if method in methods), None)


def method_hint(method: str) -> str:
    """``""`` for a method kvq does not ship; else which distribution provides it and the command that installs
    it (for error messages about a method that is not installed)."""
    dist = distribution_of(method)
    if dist is None:
        return ""
    return f"{method!r} comes with {dist}, which is not installed here; install it with: {install_command(dist)}"


#: Names of optimised BLAS libraries: MLX's CPU matrix products are fast when one of them provides ``cblas_sgemm``.
FAST_BLAS = ("openblas", "libmkl", "libblis", "flexiblas")

#: The reference BLAS that MLX's Linux CPU wheel bundles (``mlx_cpu.libs/libblas-<hash>.so.3``), as it appears in
#: ``/proc/self/maps``.
BUNDLED_BLAS = "mlx_cpu.libs/libblas"


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def blas_provider() -> str | None:
    """The file of the library that provides ``cblas_sgemm`` in this process's global symbol scope, or ``None``.

    The dynamic linker binds MLX's ``cblas_sgemm`` to the global scope (the program, its libraries and anything in
    ``LD_PRELOAD``) before MLX's own dependencies, so a BLAS found here is the one MLX calls; MLX's bundled
    reference BLAS, loaded with MLX's extension module, is not in that scope. A BLAS that another package bundles
    for itself (numpy's ``libscipy_openblas64_``, whose symbols are renamed) is mapped into the process but never
    found here: that is why mere presence in ``/proc/self/maps`` says nothing (a new user's run without OpenBLAS
    got no note once numpy was imported).
    """
    try:
        process = ctypes.CDLL(None)
        address = ctypes.cast(process.cblas_sgemm, ctypes.c_void_p)
    except (AttributeError, OSError):
        return None
    info = _DlInfo()
    for lib in (process, "libdl.so.2"):  # glibc >= 2.34 has dladdr in libc, older ones in libdl
        try:
            dladdr = (ctypes.CDLL(lib) if isinstance(lib, str) else lib).dladdr
        except (AttributeError, OSError):
            continue
        if dladdr(address, ctypes.byref(info)) and info.dli_fname:
            return os.fsdecode(info.dli_fname)
    return None


_UNSET = object()


def blas_hint(maps: str | None = None, provider=_UNSET) -> str | None:
    """A one-line note for Linux CPU users whose MLX runs matrix products with the reference BLAS its wheel bundles
    (about 5 GFLOP/s on a 2-core machine; with Debian's OpenBLAS preloaded about 150, which makes model runs about
    25x faster: README, "Quick start"); ``None`` elsewhere, when MLX does not use its bundled BLAS
    (:data:`BUNDLED_BLAS` not mapped: an MLX built against another BLAS) or an optimised one (:data:`FAST_BLAS`)
    provides ``cblas_sgemm`` ahead of it (:func:`blas_provider`), or with ``KVQ_NO_BLAS_HINT=1``.

    :param maps: this process's memory map (``/proc/self/maps``; read when ``None``).
    :param provider: the file providing ``cblas_sgemm`` globally, or ``None`` for none (:func:`blas_provider`
        when not given).
    """
    import platform

    if not sys.platform.startswith("linux") or os.environ.get("KVQ_NO_BLAS_HINT") == "1":
        return None
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return None
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    if BUNDLED_BLAS not in maps:
        return None
    provider = blas_provider() if provider is _UNSET else provider
    if provider is not None and any(name in Path(provider).name.lower() for name in FAST_BLAS):
        return None
    lib = f"/usr/lib/{platform.machine()}-linux-gnu/openblas-pthread/libopenblas.so.0"
    install = "" if Path(lib).exists() else "apt-get install libopenblas0-pthread, then "
    return (f"kvq: note: MLX on this Linux CPU runs matrix products with its bundled reference BLAS; model runs are "
            f"about 25x faster with OpenBLAS: {install}export LD_PRELOAD={lib} (README, 'Quick start'; "
            "KVQ_NO_BLAS_HINT=1 hides this note)")


#: Whether :func:`note_blas_before_model_work` prints :func:`blas_hint` (the CLI arms it for its model-running
#: commands; library calls stay silent), and whether it has printed it in this process.
_BLAS_NOTE = {"armed": False, "shown": False}


def arm_blas_note(armed: bool = True) -> None:
    """Have :func:`note_blas_before_model_work` print :func:`blas_hint` once (``kvq``'s model-running commands
    call this before parsing their arguments, so a usage error prints no note)."""
    _BLAS_NOTE.update(armed=armed, shown=False)


def note_blas_before_model_work() -> None:
    """Print :func:`blas_hint` on stderr, once, if :func:`arm_blas_note` armed it: called where model work starts
    (:func:`kvq.models.load`, :func:`kvq.bench.random_model.build_random_model`)."""
    if not _BLAS_NOTE["armed"] or _BLAS_NOTE["shown"]:
        return
    _BLAS_NOTE["shown"] = True
    hint = blas_hint()
    if hint:
        print(hint, file=sys.stderr, flush=True)
