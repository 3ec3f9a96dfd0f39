"""Where kvq keeps files on disk: one root for everything it caches (converted models, autotune tables, kernel
texts), so that one variable moves them all."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_root() -> Path:
    """kvq's cache folder: ``$KVQ_CACHE_DIR`` when set (``~`` expanded), else platformdirs' user cache dir for
    ``"kvq"``. Not created here; read on every call, so a test or a user may change the variable at run time."""
    override = os.environ.get("KVQ_CACHE_DIR")
    return Path(override).expanduser() if override else Path(platformdirs.user_cache_dir("kvq"))
