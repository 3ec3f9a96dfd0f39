"""Calibration of ``vecinfer``: smoothing factors and k-means codebooks from a model's real keys and values.

VecInfer (Yao et al., arXiv 2510.06175) learns its codebooks offline. Here: record every layer's keys and values
over calibration text (:mod:`kvq_backends_vecinfer.collect`), compute per-channel smoothing factors of the keys
(``s = max |K| ** alpha`` per KV head and channel; ``alpha = 0.5`` is the square root), transform (keys:
``H (k / s)``; values: ``H v``), split into sub-vectors, and run k-means (:mod:`kvq_backends_vecinfer.kmeans`) per
layer (and per head with ``per_head``). Results are saved by :mod:`kvq_backends_vecinfer.storage`.

The default text is the first half of :func:`kvq.textdata.language_reference`; :func:`heldout_text` (the second
half, less the paragraphs the first repeats) is never used for calibration, so evaluations on it are out of sample.

As ``vecinfer``'s calibration module (``kvq.Method(calibrate=...)``) it offers ``add_arguments`` and ``run`` to
``kvq calibrate``, and :func:`model_id_for` to the commands that run a model (``kvq generate --model M --method
vecinfer`` uses the calibration ``kvq calibrate --model M`` wrote: :func:`kvq.evaluation.spec.model_namer`).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import attrs
import mlx.core as mx
from tqdm.auto import tqdm

from . import storage, vq
from .collect import Recording, record
from .kmeans import kmeans
from .params import VecInferParams
from .storage import model_id_for  # kvq's commands that run a model read it here (the calibration module)

_EPS = 1e-6
DEFAULT_SOURCE = "kvq.textdata.language_reference(), first half"


def _split() -> tuple[str, str]:
    """The language reference cut in two at the blank line after its middle, the second half without the paragraphs
    the first also holds (pydoc's topics repeat some: about a fifth of the second half on CPython 3.11; which
    paragraphs sit near the cut differs between patch releases, and on 3.11.2 the first half ended inside one)."""
    from kvq.textdata import language_reference

    text = language_reference()
    cut = text.find("\n\n", len(text) // 2)
    first = text[:cut]
    seen = set(first.split("\n\n"))
    return first, "\n\n".join(p for p in text[cut + 2:].split("\n\n") if p not in seen)


def calibration_text() -> str:
    """The default calibration text: the first half of the Python language reference (cut at a blank line)."""
    return _split()[0]


def heldout_text() -> str:
    """The second half of the Python language reference less the paragraphs :func:`calibration_text` holds too
    (the topics repeat some): disjoint from it paragraph by paragraph, for evaluation."""
    return _split()[1]


def smoothing_factors(keys: mx.array, alpha: float = 0.5) -> mx.array:
    """Per-channel smoothing factors ``max |K| ** alpha`` of keys float32 ``[H_kv, N, D]``: float32 ``[H_kv, D]``.

    Factors are at least 1e-6 (a channel that is always 0 is left as is, not divided by 0).
    """
    return mx.maximum(mx.max(mx.abs(keys), axis=1), _EPS) ** alpha


def train_codebooks(x: mx.array, smoothing: mx.array | None, params: VecInferParams, *, seed: int = 0,
                    iterations: int = 20, points_per_centroid: int = 128) -> mx.array:
    """k-means codebooks of one layer's keys or values ``x`` float32 ``[H_kv, N, D]``.

    :param smoothing: ``[H_kv, D]`` for keys, ``None`` for values.
    :param params: gives ``sub_dim``, ``code_bits``, ``per_head``, ``role`` and ``layer`` (the last two, with
        ``seed``, seed k-means).
    :return: float32 ``[G, 2**code_bits, sub_dim]``, ``G`` = ``H_kv`` with ``per_head``, else 1.
    """
    y = vq.sub_vectors(vq.transform(x[None], smoothing)[0], params.sub_dim)  # [H, N, M, S]
    groups = [y[h] for h in range(y.shape[0])] if params.per_head else [y]
    books = []
    for g, points in enumerate(groups):
        seeds = [seed, params.layer or 0, params.role == "values", params.sub_dim, params.code_bits, g]
        centroids, _ = kmeans(points.reshape(-1, params.sub_dim), 2**params.code_bits, seed=seeds,
                              iterations=iterations, points_per_centroid=points_per_centroid)
        books.append(centroids)
    return mx.stack(books)


@attrs.frozen
class Options:
    """How a calibration is made (recorded in each file's metadata).

    :param seed: seeds k-means. :param smooth_alpha: exponent of the smoothing factors (0.5: square root).
    :param iterations: Lloyd iterations at most. :param points_per_centroid: k-means training points per centroid.
    :param source: description of the calibration text. :param seq_len: tokens per recorded sequence.
    """

    seed: int = 0
    smooth_alpha: float = 0.5
    iterations: int = 20
    points_per_centroid: int = 128
    source: str = DEFAULT_SOURCE
    seq_len: int = 512


def calibrate(recording: Recording, model_id: str, settings: list[VecInferParams], options: Options = Options(),
              progress: bool = True) -> list[Path]:
    """Compute and save a calibration file per entry of ``settings`` (their ``layer`` is ignored).

    :param recording: keys/values per layer from :func:`kvq_backends_vecinfer.collect.record`.
    :param model_id: the id to store under (:func:`model_id_for`).
    :return: the paths written.
    """
    smoothing = [smoothing_factors(k, options.smooth_alpha) for k in recording.keys]
    bar = tqdm(total=len(settings) * len(recording.layers), desc="k-means codebooks", unit="layer",
               disable=not progress)
    paths = []
    for setting in settings:
        setting = attrs.evolve(setting, model_id=model_id, layer=None)
        arrays = {}
        for j, layer in enumerate(recording.layers):
            data = recording.keys[j] if setting.role == "keys" else recording.values[j]
            s = smoothing[j] if setting.smoothed else None
            arrays[f"codebook.{layer}"] = train_codebooks(data, s, setting.for_layer(layer), seed=options.seed,
                                                          iterations=options.iterations,
                                                          points_per_centroid=options.points_per_centroid)
            if s is not None:
                arrays[f"smoothing.{layer}"] = s
            mx.eval(arrays)
            bar.update()
        meta = _meta(recording, setting, options)
        paths.append(storage.save(storage.Calibration(meta, arrays, storage.path_for(setting))))
    bar.close()
    return paths


def _meta(recording: Recording, setting: VecInferParams, options: Options) -> dict:
    from kvq import __version__

    H, N, D = recording.keys[0].shape
    return {"format": storage.FORMAT, "kvq": __version__, "method": "vecinfer", "model_id": setting.model_id,
            "role": setting.role, "sub_dim": setting.sub_dim, "code_bits": setting.code_bits,
            "per_head": setting.per_head, "head_dim": D, "num_kv_heads": H, "layers": list(recording.layers),
            "tokens": N, **attrs.asdict(options), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def add_arguments(parser) -> None:
    """``kvq calibrate --method vecinfer``'s own options, each ``dest`` named as :func:`run`'s keyword."""
    parser.add_argument("--sub-dim", dest="sub_dims", metavar="SUB_DIM", type=int, nargs="+", default=[4, 8],
                        help="sub-vector sizes (default 4 8)")
    parser.add_argument("--code-bits", type=int, nargs="+", default=[8], help="bits per code (default 8)")
    parser.add_argument("--role", dest="roles", choices=("keys", "values"), nargs="+", default=["keys", "values"],
                        help="which side's codebooks to calibrate (default: keys values)")
    parser.add_argument("--per-head", action="store_true", help="one codebook per KV head (default: one per layer)")
    parser.add_argument("--smooth-alpha", type=float, default=0.5, help="key smoothing factor max|K|**alpha, 0..1 (default 0.5)")
    parser.add_argument("--iterations", type=int, default=20, help="k-means iterations at most, >= 1 (default 20)")


def run(model: str | None = None, *, text: str | None = None, text_name: str | None = None, tokens: int = 4096,
        seq_len: int = 512, sub_dims=(4, 8), code_bits=(8,), roles=("keys", "values"), per_head: bool = False,
        seed: int = 0, smooth_alpha: float = 0.5, iterations: int = 20, points_per_centroid: int = 128,
        model_id: str | None = None, progress: bool = True) -> list[Path]:
    """Calibrate ``vecinfer`` for a model, for every combination of ``roles`` x ``sub_dims`` x ``code_bits``.

    :param model: anything :func:`kvq.models.load` accepts (``None``: SmolLM2-135M-Instruct); run in float32.
    :param text: calibration text (``None``: :func:`calibration_text`); ``text_name`` describes it in metadata.
    :param tokens: use the first ``tokens`` tokens of the text, in sequences of ``seq_len``.
    :param model_id: store under this id instead of :func:`model_id_for` ``(model)``.
    :return: the calibration files written.
    :raises ValueError: bad settings (before the model is run), a model that cannot be loaded, too little text.
    """
    settings = [VecInferParams(role=r, sub_dim=s, code_bits=c, per_head=per_head)
                for r in roles for s in sub_dims for c in code_bits]
    if tokens < 16 or seq_len < 16:
        raise ValueError(f"tokens and seq_len must be >= 16; got tokens={tokens}, seq_len={seq_len}")
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1 (k-means iterations); got {iterations}")
    if not 0 <= smooth_alpha <= 1:
        raise ValueError(f"smooth_alpha must be in [0, 1] (keys are smoothed by max|K|**alpha); got {smooth_alpha}")
    from kvq.models import load
    from kvq.textdata import encode_text

    loaded, tokenizer = load(model, dtype=mx.float32, progress=progress)
    head_dim = _head_dim(loaded)
    for s in settings if head_dim else ():
        s.check_head_dim(head_dim)  # fail before the slow part
    if text is None:
        text, text_name = calibration_text(), DEFAULT_SOURCE
    ids = encode_text(tokenizer, text, special_tokens=True)  # longer than the model's context on purpose
    recording = record(loaded, ids, seq_len, tokens, progress=progress)
    source = text_name or f"text sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"
    options = Options(seed, smooth_alpha, iterations, points_per_centroid, source, seq_len)
    for s in settings:
        s.check_head_dim(recording.keys[0].shape[-1])
    return calibrate(recording, model_id or model_id_for(model), settings, options, progress)


def _head_dim(model) -> int | None:
    """head_dim from an mlx-lm model's ``args`` (``None`` when it does not say)."""
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    return getattr(args, "head_dim", None) or (heads and args.hidden_size // heads) or None
