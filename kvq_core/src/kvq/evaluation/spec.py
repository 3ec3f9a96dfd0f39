"""Method strings of ``kvq eval`` and ``kvq bench``: validation against the installed methods, and the caches
they build. The grammar and its parser are :mod:`kvq.cache.method_string` (re-exported here).
"""

from __future__ import annotations

import re
import shlex

import attrs

from ..defaults import DEFAULT_SINKS, DEFAULT_WINDOW
from ..cache.method_string import (  # noqa: F401
    CACHE_OPTIONS,
    KVQ_FP16,
    MLX_AFFINE,
    MLX_BITS,
    MLX_GROUP_SIZES,
    REFERENCE,
    REFERENCE_ALIASES,
    MethodSpec,
    parse_method,
    split_methods,
)

#: The parameter naming the calibrated model, in a method that declares a calibration (``kvq.Method(calibrate=)``):
#: the name ``kvq calibrate --model-id`` and the calibration module's ``run(model_id=)`` give it too.
MODEL_ID = "model_id"


def reference_label(dtype) -> str:
    """``"kvcache (float32)"``: the reference and the dtype it holds keys and values in (an ``mx.Dtype`` or its
    name)."""
    return f"{REFERENCE} ({str(dtype).removeprefix('mlx.core.')})"


def model_dtype(model):
    """The dtype the model computes its keys and values in (the reference cache's): its key projection's weight
    dtype, or for a quantized model (``QuantizedLinear``, integer weights) the dtype of its scales."""
    projection = model.layers[0].self_attn.k_proj
    return getattr(projection, "scales", projection.weight).dtype


def _check_mlx(spec: MethodSpec, head_dim: int | None) -> None:
    if spec.cache_options:
        raise ValueError(f"method {spec.label!r}: {MLX_AFFINE} has no sinks or window (mlx-lm's QuantizedKVCache "
                         "quantizes every token)")
    if spec.key_params != spec.value_params:
        raise ValueError(f"method {spec.label!r}: {MLX_AFFINE} uses the same bits for keys and values")
    unknown = set(spec.key_params) - {"bits", "group_size"}
    if unknown:
        raise ValueError(f"method {spec.label!r}: unknown parameter(s) {', '.join(sorted(unknown))} for "
                         f"{MLX_AFFINE}; allowed: bits, group_size")
    bits, group_size = spec.mlx_settings()
    if bits not in MLX_BITS or group_size not in MLX_GROUP_SIZES:
        raise ValueError(f"method {spec.label!r}: {MLX_AFFINE} needs bits in {MLX_BITS} and group_size in "
                         f"{MLX_GROUP_SIZES}; got bits={bits}, group_size={group_size}")
    if head_dim is not None and head_dim % group_size:
        raise ValueError(f"method {spec.label!r}: group_size {group_size} does not divide head_dim {head_dim}")


def validate(spec: MethodSpec, head_dim: int | None = None, sinks: int = DEFAULT_SINKS,
             window: int = DEFAULT_WINDOW) -> None:
    """Check a spec against the installed methods (and ``head_dim`` when known), without building a cache.

    :raises ValueError: unknown method (the installed ones are listed), parameter out of range, or a head_dim
        the method does not support; the message starts with the method string.
    """
    if spec.is_reference:
        return None
    if spec.is_mlx or spec.value_method == MLX_AFFINE:
        return _check_mlx(spec, head_dim)
    from ..cache import make_config

    try:
        config = make_config(**spec.cache_kwargs(sinks, window))
        if head_dim is not None:
            config.check_head_dim(head_dim)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"method {spec.label!r}: {exc}") from None


def parse_methods(text: str, head_dim: int | None = None, sinks: int = DEFAULT_SINKS,
                  window: int = DEFAULT_WINDOW) -> list[MethodSpec]:
    """Parse and validate ``--methods``; the reference (:data:`REFERENCE`) is put first, added if missing.

    :raises ValueError: a string that does not parse, an unknown method or parameter, a duplicate label.
    """
    return checked_with_reference([parse_method(s) for s in split_methods(text)], head_dim, sinks, window)


def checked_with_reference(specs: list[MethodSpec], head_dim: int | None, sinks: int, window: int,
                           reference: str = REFERENCE) -> list[MethodSpec]:
    """``specs`` validated (:func:`validate`), with the ``reference`` method first (added if missing).

    :raises ValueError: a label given more than once, or a spec :func:`validate` rejects.
    """
    labels = [s.label for s in specs]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        aliases = (f" ({' and '.join(REFERENCE_ALIASES)} also name{'s' if len(REFERENCE_ALIASES) == 1 else ''} "
                   f"{REFERENCE}, mlx-lm's own cache; kvq's 16-bit cache is {KVQ_FP16})"
                   if REFERENCE in duplicates else "")
        raise ValueError(f"--methods: {', '.join(duplicates)} given more than once{aliases}")
    for spec in specs:
        validate(spec, head_dim, sinks, window)
    first = [s for s in specs if s.label == reference] or [parse_method(reference)]
    return first + [s for s in specs if s.label != reference]


def bits_per_coordinate(spec: MethodSpec, head_dim: int, dtype=None) -> tuple[float, float]:
    """``(keys, values)`` bits per coordinate of the compressed tokens (sinks and window excluded).

    The reference counts the width of ``dtype``, the model's (16 bits when not given). ``mlx-affine`` counts a
    16-bit scale and bias per group, as mlx-lm stores them in a float16 model (a float32 model stores 32-bit ones:
    the measured bytes show it).
    """
    if spec.is_reference:
        return (float(dtype.size * 8 if dtype is not None else 16),) * 2
    if spec.is_mlx:
        bits, group_size = spec.mlx_settings()
        return (bits + 32 / group_size,) * 2
    from ..cache import make_config

    config = make_config(**spec.cache_kwargs(0, 0)).within_budget(head_dim, head_dim)
    kp, vp = config.key_params, config.value_params
    return kp.accounting(head_dim).bits_per_coordinate, vp.accounting(head_dim).bits_per_coordinate


def model_namer(method: str):
    """How ``method``'s calibrations name a model: its calibration module's ``model_id_for(model) -> str`` (the id
    ``kvq calibrate --model MODEL`` stores under), or ``None`` where ``method`` declares no calibration, its
    parameters have no :data:`MODEL_ID`, or its module does not say. Imports that module (only for such a method).
    """
    from ..cli.calibrate_cmd import calibration
    from ..plugins import registry

    declaration = registry().method(method)
    if not declaration.calibrate or MODEL_ID not in attrs.fields_dict(declaration.params_class):
        return None
    return getattr(calibration(declaration), "model_id_for", None)


def model_ids(cache_kwargs: dict, model: str | None) -> dict[str, str]:
    """``{"key_params": id, "value_params": id}`` for each side of the cache ``cache_kwargs`` describes (keywords of
    :func:`kvq.cache.make_config`) whose method is calibrated per model (:func:`model_namer`) and whose
    :data:`MODEL_ID` is not given: the id of ``model``'s calibration (``None``: the default model)."""
    from ..cache import make_config

    config = make_config(**cache_kwargs)
    ids = {}
    for side, params in (("key_params", config.key_params), ("value_params", config.value_params)):
        namer = model_namer(params.method)
        if namer is not None and getattr(params, MODEL_ID) is None:
            ids[side] = namer(model)
    return ids


def for_model(cache_kwargs: dict, model: str | None) -> dict:
    """``cache_kwargs`` (keywords of :func:`kvq.cache.make_config`) for a cache of ``model``: each side calibrated
    per model names ``model``'s calibration (:func:`model_ids`) unless ``model_id`` is given; then checked as the
    cache will check them at construction, before any model is loaded (:func:`check_ready`).

    :raises ValueError: bad methods or parameters, or parameters not ready (e.g. no calibration of ``model``: the
        message gives the ``kvq calibrate --model`` command for ``model`` as given).
    """
    ids = model_ids(cache_kwargs, model)
    kwargs = {**cache_kwargs, **{side: _named(cache_kwargs.get(side), i) for side, i in ids.items()}}
    try:
        check_ready(kwargs)
    except ValueError as error:
        raise ValueError(_as_given(str(error), model, ids.values())) from None
    return kwargs


def spec_for_model(spec: MethodSpec, model: str | None, head_dim: int | None = None, sinks: int = DEFAULT_SINKS,
                   window: int = DEFAULT_WINDOW, *, calibrated: bool = True) -> MethodSpec:
    """``spec`` for a cache of ``model``, as :func:`for_model`, and validated for ``head_dim`` (:func:`validate`).

    :param calibrated: ``False`` for a model that has no calibration (``kvq bench``'s ``random:PRESET``): a
        method calibrated per model must then name one in the method string (``vecinfer[model_id=M]``).
    :raises ValueError: as :func:`for_model` and :func:`validate`, the message starting with the method string.
    """
    if spec.is_reference or spec.is_mlx or spec.value_method == MLX_AFFINE:
        validate(spec, head_dim, sinks, window)
        return spec
    ids = model_ids(spec.cache_kwargs(sinks, window), model)
    if ids and not calibrated:
        method = spec.key_method if "key_params" in ids else spec.value_method
        raise ValueError(f"method {spec.label!r}: {method} uses a model's calibration and {model} has none: write "
                         f"{method}[model_id=M] with M a model calibrated by 'kvq calibrate --model M'")
    spec = attrs.evolve(spec, key_params=_named(spec.key_params, ids.get("key_params")),
                        value_params=_named(spec.value_params, ids.get("value_params")))
    try:
        validate(spec, head_dim, sinks, window)
        check_ready(spec.cache_kwargs(sinks, window))
    except ValueError as error:
        text = str(error) if str(error).startswith(f"method {spec.label!r}") else f"method {spec.label!r}: {error}"
        raise ValueError(_as_given(text, model, ids.values())) from None
    return spec


def check_ready(cache_kwargs: dict) -> None:
    """Raise now what :func:`kvq.make_prompt_cache` raises at construction for parameters that cannot encode yet
    (their ``check_ready``: :class:`kvq.contract.ChecksReady`).

    :raises ValueError: as :func:`kvq.cache.make_config`, or what ``check_ready`` raises.
    """
    from ..cache import make_config
    from ..contract import ChecksReady, optional_hook

    config = make_config(**cache_kwargs)
    for params in (config.key_params, config.value_params):
        hook = optional_hook(params, ChecksReady)
        if hook is not None:
            hook()


def _named(params: dict | None, model_id: str | None) -> dict:
    """``params`` with :data:`MODEL_ID` set to ``model_id`` (unchanged where it is ``None``)."""
    return {**(params or {}), **({} if model_id is None else {MODEL_ID: model_id})}


def _as_given(message: str, model: str | None, ids) -> str:
    """``message`` with ``kvq calibrate --model ID``, for each id in ``ids`` (named after ``model``), naming
    ``model`` as given: a folder or .gguf file is named by its path there, its calibration by its name."""
    for i in ids if model is not None else ():
        message = re.sub(rf"(kvq calibrate --model ){re.escape(i)}(?=\s|'|$)",
                         lambda m: m[1] + shlex.quote(str(model)), message)
    return message


def make_cache(model, spec: MethodSpec, sinks: int, window: int) -> list:
    """One cache per layer of ``model`` for ``spec``: kvq's (:func:`kvq.make_prompt_cache`), for the reference the
    caches mlx-lm makes for the model (``KVCache``; ``RotatingKVCache`` on sliding-window layers), or for mlx-affine
    mlx-lm's ``QuantizedKVCache`` where the model's own cache is a plain ``KVCache``; mlx-lm cannot quantize its
    other caches (``RotatingKVCache.to_quantized``: "RotatingKVCache Quantization NYI"), so a sliding-window layer
    keeps mlx-lm's ``RotatingKVCache`` in the model's dtype, as ``generate --kv-bits`` would need it to."""
    if spec.is_reference:
        from ..cache.patch import mlx_lm_caches

        return mlx_lm_caches(model)
    if spec.is_mlx:
        from mlx_lm.models.cache import KVCache, QuantizedKVCache

        from ..cache.patch import mlx_lm_caches

        bits, group_size = spec.mlx_settings()
        return [QuantizedKVCache(group_size=group_size, bits=bits) if type(c) is KVCache else c
                for c in mlx_lm_caches(model)]
    from ..cache import make_prompt_cache

    return make_prompt_cache(model, **spec.cache_kwargs(sinks, window))


def make_layer_cache(spec: MethodSpec, sinks: int, window: int, layer: int = 0,
                     sliding: tuple[int, int] | None = None, still: tuple | None = None):
    """The cache of layer ``layer`` for ``spec`` (used to replay one layer's keys and values): parameters bound to
    that layer as :func:`kvq.make_prompt_cache` binds them (VecInfer's per-layer codebooks).

    :param sliding: ``(max_size, keep)`` of a sliding-window layer: a :class:`~kvq.cache.RotatingKVQCache` of that
        size (mlx-affine: mlx-lm's ``RotatingKVCache``, which mlx-lm cannot quantize), as :func:`make_cache` gives
        that layer.
    :param still: the key channels the layer's RoPE keeps still (:mod:`kvq.cache.still`), as
        :func:`kvq.make_prompt_cache` found them for the model run, or ``None``.
    """
    if spec.is_reference:
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        return KVCache() if sliding is None else RotatingKVCache(*sliding)
    if spec.is_mlx:
        from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

        if sliding is not None:
            return RotatingKVCache(*sliding)
        bits, group_size = spec.mlx_settings()
        return QuantizedKVCache(group_size=group_size, bits=bits)
    from ..cache import KVQCache, RotatingKVQCache, make_config

    config = attrs.evolve(make_config(**spec.cache_kwargs(sinks, window)).for_layer(layer), still_channels=still)
    return KVQCache(config) if sliding is None else RotatingKVQCache(config, *sliding)
