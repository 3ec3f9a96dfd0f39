"""Install commands for kvq's own distributions, worded for how this kvq was installed.

The core imports no plugin; it only knows which of kvq's own distributions provides which method, so that an
error about a missing method can say what to install. The command works where it is shown: when ``kvq-core`` was
installed from a local folder (a clone of the kvq repository: ``uv sync``, ``pip install ./kvq_core``), the hint
names the sibling folder of that clone (``uv pip install /path/to/kvq/kvq_backends_turboquant``); otherwise the
distribution's PyPI name. Third-party plugins are not listed: their own documentation says how to install them.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

#: kvq's own distributions: name -> (folder in the repository, methods it provides).
DISTRIBUTIONS = {
    "kvq-core": ("kvq_core", ()),
    "kvq-backends-turboquant": ("kvq_backends_turboquant", ("turboquant", "turboquant_prod", "turboquant_rvq")),
    "kvq-backends-qjl": ("kvq_backends_qjl", ("qjl",)),
    "kvq-backends-vecinfer": ("kvq_backends_vecinfer", ("vecinfer",)),
    "kvq-metal": ("kvq_metal", ()),
}


@lru_cache(maxsize=1)
def _checkout() -> Path | None:
    """The repository folder ``kvq-core`` was installed from (``direct_url.json`` of its metadata), if local."""
    try:
        text = metadata.distribution("kvq-core").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if not text:
        return None
    url = urlparse(json.loads(text).get("url", ""))
    if url.scheme != "file":
        return None
    return Path(unquote(url.path)).parent


def install_command(distribution: str, extra: str | None = None) -> str:
    """A command that installs ``distribution`` (one of :data:`DISTRIBUTIONS`, or any PyPI name), with an optional
    extra (``"plots"``), here: from the local clone kvq-core came from when there is one, else from PyPI by name."""
    folder = DISTRIBUTIONS.get(distribution, (None,))[0]
    root = _checkout()
    suffix = f"[{extra}]" if extra else ""
    if folder is not None and root is not None and (root / folder / "pyproject.toml").is_file():
        target = f"'{root / folder}{suffix}'" if extra else str(root / folder)
        return f"uv pip install {target}  (or: pip install {target})"
    return f"pip install '{distribution}{suffix}'" if extra else f"pip install {distribution}"


def distribution_of(method: str) -> str | None:
    """The kvq distribution that provides ``method``, or ``None`` (a core method, or one kvq does not ship)."""
    return next((name for name, (_, methods) in DISTRIBUTIONS.items() if method in methods), None)


def method_hint(method: str) -> str:
    """``""`` for a method kvq does not ship; else which distribution provides it and the command that installs
    it (for error messages about a method that is not installed)."""
    dist = distribution_of(method)
    if dist is None:
        return ""
    return f"{method!r} comes with {dist}, which is not installed here; install it with: {install_command(dist)}"
