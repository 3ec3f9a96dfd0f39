"""Calibration files of ``vecinfer``: per-layer codebooks and smoothing factors, as safetensors with JSON metadata.

Layout: ``<root>/calibration/<model id>/vecinfer-<role>-sub<sub_dim>-bits<code_bits>[-per-head].safetensors``, where
``<root>`` is ``$KVQ_DATA_DIR`` or ``platformdirs.user_data_dir("kvq")``. A file holds, for every recorded layer
``i``: ``codebook.<i>`` float32 ``[G, 2**code_bits, sub_dim]`` (``G`` = 1, or the KV heads with ``per_head``) and,
for keys, ``smoothing.<i>`` float32 ``[H_kv, head_dim]``. Its metadata key ``kvq_calibration`` is a JSON object:
format version, kvq version, method, model id, role, sub_dim, code_bits, per_head, head_dim, num_kv_heads,
layers, and how it was made (text, tokens, seed, smoothing exponent, iterations).

Files are read once per process and kept (a running cache must keep decoding with the codebook it encoded with);
:func:`forget` drops them, and ``kvq calibrate`` calls it after writing.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import attrs
import mlx.core as mx
import platformdirs

#: Bump when the file layout changes; files of another format are refused with the command to recompute them.
FORMAT = 1
#: ``kvq.models.DEFAULT_MODEL``, the model that ``model_id="default"`` names (kept here so params stay import-light).
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
METADATA_KEY = "kvq_calibration"
_LOADED: dict[Path, Calibration] = {}


class CalibrationError(ValueError):
    """A vecinfer calibration that is missing, unreadable, or made for another model, setting or shape."""


def data_root() -> Path:
    """``$KVQ_DATA_DIR`` if set, else ``platformdirs.user_data_dir("kvq")`` (not created here)."""
    override = os.environ.get("KVQ_DATA_DIR")
    return Path(override).expanduser() if override else Path(platformdirs.user_data_dir("kvq"))


def model_dir(model_id: str) -> Path:
    """``<root>/calibration/<model id>``; ``/`` in Hub ids becomes ``--`` and other unsafe characters ``_``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model_id.replace("/", "--"))
    return data_root() / "calibration" / safe


def file_name(role: str, sub_dim: int, code_bits: int, per_head: bool) -> str:
    """The file name of one setting, e.g. ``vecinfer-keys-sub4-bits8.safetensors``."""
    return f"vecinfer-{role}-sub{sub_dim}-bits{code_bits}{'-per-head' if per_head else ''}.safetensors"


def model_id_for(model: str | os.PathLike | None) -> str:
    """The id ``kvq calibrate --model MODEL`` stores a calibration under, and the one to look it up by: the
    default model's name (for ``None``, ``"default"`` or that name), a model folder's name, a GGUF file's stem, or
    a Hub id as given (``org/name``). kvq's commands that run a model name its calibration with it (the
    calibration module's ``model_id_for``: :mod:`kvq_backends_vecinfer.calibrate`)."""
    if model in (None, "default", DEFAULT_MODEL_ID):
        return DEFAULT_MODEL_ID
    path = Path(model).expanduser()
    if path.exists():
        return path.resolve().stem if path.is_file() else path.resolve().name
    return str(model)


def path_for(params) -> Path:
    """Where the calibration named by ``params`` (a :class:`VecInferParams` with a ``model_id``) lives."""
    return model_dir(params.model_id) / file_name(params.role, params.sub_dim, params.code_bits, params.per_head)


def calibrate_command(params) -> str:
    """The ``kvq calibrate`` command line that writes the calibration ``params`` asks for."""
    flags = f" --sub-dim {params.sub_dim} --code-bits {params.code_bits}" + (" --per-head" if params.per_head else "")
    return f"kvq calibrate --model {params.model_id}{flags}"


@attrs.frozen(eq=False)
class LayerCodebook:
    """What quantize/dequantize/attend need for one layer and role.

    :param codebook: float32 ``[G, K, sub_dim]`` (``K = 2**code_bits``; ``G`` = 1 or ``H_kv``).
    :param smoothing: float32 ``[H_kv, D]`` per-channel divisors of keys, or ``None`` (values).
    :param num_kv_heads: ``H_kv`` the calibration was recorded with.
    """

    codebook: mx.array
    smoothing: mx.array | None
    num_kv_heads: int


@attrs.frozen(eq=False)
class Calibration:
    """One calibration file in memory.

    :param meta: the file's metadata (see the module docstring).
    :param arrays: ``codebook.<i>`` and (keys) ``smoothing.<i>`` per recorded layer ``i``.
    :param path: where it was read from or will be written to.
    """

    meta: dict
    arrays: dict
    path: Path

    @property
    def head_dim(self) -> int:
        """``D`` of the recorded keys and values."""
        return int(self.meta["head_dim"])

    @property
    def num_kv_heads(self) -> int:
        """``H_kv`` of the recorded keys and values."""
        return int(self.meta["num_kv_heads"])

    @property
    def layers(self) -> tuple[int, ...]:
        """Indices in ``model.layers`` that have codebooks."""
        return tuple(self.meta["layers"])

    def check_head_dim(self, head_dim: int) -> None:
        """:raises CalibrationError: the calibration was made for another head_dim."""
        if head_dim != self.head_dim:
            raise CalibrationError(f"{self.path}: this calibration of {self.meta['model_id']!r} is for head_dim "
                                   f"{self.head_dim}, not {head_dim}: is model_id the model you run?")

    def layer(self, index: int) -> LayerCodebook:
        """The codebook (and smoothing) of layer ``index``. :raises CalibrationError: a layer it does not cover."""
        if index not in self.layers:
            raise CalibrationError(f"{self.path}: no codebook for layer {index}; it covers layers "
                                   f"{self.layers[0]}..{self.layers[-1]} of {self.meta['model_id']!r}")
        return LayerCodebook(self.arrays[f"codebook.{index}"], self.arrays.get(f"smoothing.{index}"),
                             self.num_kv_heads)


def save(calibration: Calibration) -> Path:
    """Write ``calibration`` to its path atomically (a temporary sibling renamed into place); returns the path.

    Drops any copy of that file held in memory (:func:`forget`).
    """
    path = calibration.path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=path.parent)
    os.close(fd)
    try:
        mx.save_safetensors(tmp, calibration.arrays, metadata={METADATA_KEY: json.dumps(calibration.meta)})
        os.chmod(tmp, 0o644)  # mkstemp makes it private; this is an ordinary data file
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    forget(path)
    return path


def forget(path: Path | None = None) -> None:
    """Drop the in-memory copy of one calibration file (``None``: all), so the next use reads the file again."""
    if path is None:
        _LOADED.clear()
    else:
        _LOADED.pop(Path(path), None)


def calibration_for(params) -> Calibration:
    """The calibration that ``params`` names, read and checked on first use, then kept in memory.

    :raises CalibrationError: ``params.model_id`` is ``None``; the file is missing (the message gives the
        ``kvq calibrate`` command to run), unreadable or corrupt, of another format, or made for another model or
        setting than its name says.
    """
    if params.model_id is None:
        raise CalibrationError(f"vecinfer needs a calibrated model: pass model_id=<the model> (after running "
                               f"'kvq calibrate --model <the model>'), e.g. kvq.make_prompt_cache(model, "
                               f"'vecinfer', model_id={DEFAULT_MODEL_ID!r})")
    path = path_for(params)
    if path not in _LOADED:
        _LOADED[path] = _read(path, params)
    return _LOADED[path]


def layer_codebook(params) -> LayerCodebook:
    """The codebook of ``params.layer``, restricted to KV heads ``params.heads`` when set (tensor parallel).

    :raises CalibrationError: no layer set, heads beyond the calibration's, or as :func:`calibration_for`.
    """
    calibration = calibration_for(params)
    if params.layer is None:
        raise CalibrationError("vecinfer params have no layer (codebooks are per layer): build caches with "
                               "kvq.make_prompt_cache(model, 'vecinfer', model_id=...), which gives layer i "
                               "params.for_layer(i), or pass layer=<index in model.layers>")
    table = calibration.layer(params.layer)
    if getattr(params, "heads", None) is None:
        return table
    start, stop = params.heads
    if stop > table.num_kv_heads:
        raise CalibrationError(f"vecinfer heads {params.heads}: the calibration of {params.model_id!r} has "
                               f"{table.num_kv_heads} KV heads")
    codebook = table.codebook[start:stop] if table.codebook.shape[0] > 1 else table.codebook  # per head or shared
    smoothing = None if table.smoothing is None else table.smoothing[start:stop]
    return LayerCodebook(codebook, smoothing, stop - start)


def _read(path: Path, params) -> Calibration:
    redo = f"recompute it with: {calibrate_command(params)}"
    if not path.is_file():
        stored = model_id_for(params.model_id)  # a path names the model that 'kvq calibrate' stored by name
        hint = "" if stored == params.model_id else f" (model_id is the name it is stored under: {stored!r})"
        raise CalibrationError(f"no vecinfer calibration for model {params.model_id!r} ({params.role}, sub_dim "
                               f"{params.sub_dim}, code_bits {params.code_bits}) at {path}; run: "
                               f"{calibrate_command(params)}{hint}")
    try:
        arrays, metadata = mx.load(str(path), return_metadata=True)
        meta = json.loads(metadata[METADATA_KEY])
    except Exception as exc:  # mx.load raises RuntimeError/ValueError on truncated or foreign files
        raise CalibrationError(f"{path} is not a readable vecinfer calibration file (corrupt or truncated?): "
                               f"{type(exc).__name__}: {exc}; {redo}") from None
    calibration = Calibration(meta, arrays, path)
    _check(calibration, params, redo)
    return calibration


def _check(calibration: Calibration, params, redo: str) -> None:
    meta, path = calibration.meta, calibration.path
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("method") != "vecinfer":
        raise CalibrationError(f"{path}: not a vecinfer calibration of format {FORMAT} (format "
                               f"{meta.get('format') if isinstance(meta, dict) else None!r}); {redo}")
    if meta.get("model_id") != params.model_id:
        raise CalibrationError(f"{path} holds a calibration of model {meta.get('model_id')!r}, not "
                               f"{params.model_id!r}; {redo}")
    expected = {"role": params.role, "sub_dim": params.sub_dim, "code_bits": params.code_bits,
                "per_head": params.per_head}
    got = {k: meta.get(k) for k in expected}
    if got != expected:
        raise CalibrationError(f"{path} holds settings {got}, not {expected}; {redo}")
    _check_arrays(calibration, params, redo)


def _check_arrays(calibration: Calibration, params, redo: str) -> None:
    meta, arrays = calibration.meta, calibration.arrays
    try:
        heads, dim, layers = int(meta["num_kv_heads"]), int(meta["head_dim"]), list(meta["layers"])
    except (KeyError, TypeError, ValueError):
        raise CalibrationError(f"{calibration.path}: metadata lacks num_kv_heads/head_dim/layers; {redo}") from None
    shapes = {f"codebook.{i}": ((heads if params.per_head else 1), 2**params.code_bits, params.sub_dim)
              for i in layers}
    if params.role == "keys":
        shapes.update({f"smoothing.{i}": (heads, dim) for i in layers})
    for name, shape in shapes.items():
        array = arrays.get(name)
        if array is None or tuple(array.shape) != shape or array.dtype != mx.float32:
            got = None if array is None else f"{array.dtype} {tuple(array.shape)}"
            raise CalibrationError(f"{calibration.path}: array {name} should be float32 {shape}, got {got}; {redo}")
