"""kvq's cache for mlx-lm: compressed storage, attention over the compressed form, prompt-cache files.

    cache = kvq.make_prompt_cache(model, "affine", bits=4)
    mlx_lm.generate(model, tokenizer, prompt, prompt_cache=cache)

Also :func:`patch_model` (so that ``mlx_lm.server`` and anything calling ``make_prompt_cache(model)`` get kvq
caches), and :func:`save_prompt_cache` / :func:`load_prompt_cache` (mlx-lm's prompt-cache files with checksums and
kvq's checks: :mod:`kvq.cache.files`), and :func:`register_with_mlx_lm` (so that mlx-lm's own ``load_prompt_cache``
reads kvq's files; every function here that makes, saves or loads kvq caches calls it, and importing this module
does not). :func:`make_prompt_cache` is the only function that makes kvq caches for a
model: per-layer parameters (VecInfer's codebooks) and a model sharded by mlx-lm (tensor or pipeline parallel,
:mod:`kvq.cache.sharding`) are handled there.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import attrs

import mlx_lm.models.cache as mlx_cache

from ..contract import ChecksReady, SideDefaults, optional_hook
from ..defaults import DEFAULT_FLUSH, DEFAULT_SINKS, DEFAULT_WINDOW
from ..plugins import registry
from . import patch as _patch
from .batch import BatchKVQCache
from ..selection import check_kernels, select
from .files import load_prompt_cache, save_prompt_cache
from .guard import OutlierLayerWarning
from .choice import block_implementation, has_attend, quantize_kernels
from .budget import spender
from .config import CacheConfig
from .layer import KVQCache
from .method_string import MLX_AFFINE, is_method_string, parse_method
from .model_args import head_dims
from .prompt import prefill_prompt
from .views import CompressedView
from .registration import register_with_mlx_lm
from .rotating import RotatingKVQCache
from .servable import UnservableModelWarning, unservable_reason
from .sharding import first_layer, kv_head_range
from .still import layer_still_channels


def _params(method: str | None, overrides: dict | None, shared: dict, side: str):
    """The parameters of one side (``"keys"`` or ``"values"``): the method's ``side_defaults(side)`` (if its
    parameter class defines it: :class:`kvq.contract.SideDefaults`, e.g. VecInfer's ``role``), then the shared
    parameters, then this side's."""
    declaration = registry().method(method)
    side_defaults = optional_hook(declaration.params_class, SideDefaults)
    defaults = side_defaults(side) if side_defaults is not None else {}
    return declaration.make_params(**{**defaults, **shared, **(overrides or {})})


def make_config(method: str | None = "affine", *, key_method: str | None = None, value_method: str | None = None,
                key_params: dict | None = None, value_params: dict | None = None, sinks: int = DEFAULT_SINKS,
                window: int = DEFAULT_WINDOW, step: int = 256, kernels: str = "auto", flush: int = DEFAULT_FLUSH,
                outlier_layers: str = "upgrade", **params: Any) -> CacheConfig:
    """A validated :class:`CacheConfig`: the methods, parameters and layout of one layer's cache, as
    :func:`make_prompt_cache` takes them (``CacheConfig.for_layer`` binds per-layer state).

    :param method: method for keys and values (``key_method``/``value_method`` override it per side; ``None``
        where both of them are given).
    :param key_params: parameters for the keys only (merged over ``params``); ``value_params`` likewise.
    :param params: parameters shared by both sides (``bits=4``). A ``bits`` that is not a whole number (``bits=3.5``)
        is a budget in bits per coordinate: each layer stores the key and value settings it buys at its head_dims
        (:mod:`kvq.cache.budget`; methods with budget settings only, such as ``turboquant``).
    :param sinks: the first tokens, kept uncompressed (attention sinks, StreamingLLM, arXiv 2309.17453): an int
        >= 0, default 4.
    :param window: the most recent tokens, kept uncompressed (the residual window, KIVI, arXiv 2402.02750): an int
        >= 0, default 128.
    :param step: tokens added to a compressed store each time it grows (an int >= 1, default 256).
    :param kernels: ``"auto"``, ``"require"`` or ``"off"`` (see :class:`CacheConfig`).
    :param flush: tokens leave the residual window in blocks of ``flush`` (default :data:`DEFAULT_FLUSH`, 128; see
        :class:`CacheConfig`).
    :param outlier_layers: ``"upgrade"`` (default), ``"warn"`` or ``"off"``: layers whose keys show outlier
        channels low-bit keys cannot hold (:mod:`kvq.cache.guard`) are stored at 8 bits with a warning, only
        warned about, or left alone.
    :raises ValueError: unknown method, parameter out of range, ``kernels`` not one of the three, a keys-only
        method (``qjl``) on the values' side, a method the cache cannot attend over (no ``kvq_attend`` and no
        ``kvq_dequantize``: :func:`kvq.cache.choice.block_implementation`).
    :raises UnknownParameterError: (a TypeError) unknown parameter name (the message lists the method's
        parameters and the cache's own settings).

    ``method`` may also be a method string as the CLI takes it (``"turboquant:3"``, ``"affine:k8v4"``,
    ``"qjl+affine:4"``, ``"turboquant:4[flush=128]"``, ``"turboquant:3.5"``; grammar and
    :func:`~kvq.cache.method_string.is_method_string`: :mod:`kvq.cache.method_string`):
    :func:`_method_string_kwargs` spells it out as these arguments, and raises ``ValueError`` where a keyword sets
    what the string sets otherwise, or where the string names mlx-lm's own caches (``kvcache``, ``mlx-affine``),
    which are not kvq caches.
    """
    if is_method_string(method):
        given = locals()  # the keyword arguments, every cache setting (cache_settings: one list, the signature's)
        return make_config(**_method_string_kwargs(method, {name: given[name] for name in cache_settings()}, params))
    check_kernels(kernels)
    if method is None and (key_method is None or value_method is None):
        missing = " and ".join(n for n, m in (("key_method", key_method), ("value_method", value_method)) if m is None)
        raise ValueError(f"method=None leaves the {missing} unnamed: give a method for both sides (e.g. "
                         f"'turboquant:4'), or key_method and value_method")
    budget = params.get("bits")
    if isinstance(budget, bool):
        raise ValueError(f"bits must be a number (whole bits, or a budget such as 3.5); got {budget!r}")
    if isinstance(budget, float) and not budget.is_integer():
        params = {k: v for k, v in params.items() if k != "bits"}  # kvq.cache.budget chooses the bits per layer
        sided = [side for side, given in (("key_params", key_params), ("value_params", value_params))
                 if "bits" in (given or {})]
        if sided:
            raise ValueError(f"bits={budget} is a budget for keys and values together (each layer's bits are chosen "
                             f"for it); drop the bits of {' and '.join(sided)}, or give whole bits per side")
    else:
        budget = None  # whole bits; a whole-valued float (4.0) is made an int by Method.make_params, per side too
    try:
        kp = _params(key_method or method, key_params, params, "keys")
        vp = _params(value_method or method, value_params, params, "values")
    except TypeError as exc:  # a misspelt cache setting reaches the method's parameters: name both lists
        raise UnknownParameterError(str(exc), _cache_settings()) from None
    if registry().method(vp.method).keys_only:
        raise ValueError(f"{vp.method} compresses keys only (it estimates inner products, not vectors): give the "
                         f"values another method, e.g. value_method='affine' (CLI: --value-method affine; "
                         f"kvq eval: {vp.method}+affine:4)")
    for p, side in ((kp, "keys"), (vp, "values")):
        if kp.method != vp.method or not has_attend(p.method):
            block_implementation(p.method, side)  # how the cache will attend: raises now if it cannot
    if budget is not None:
        for p in (kp, vp):
            spender(p)  # a method without budget settings is named now
    return CacheConfig(kp, vp, sinks, window, step, kernels, flush, outlier_layers, budget=budget)


class UnknownParameterError(TypeError):
    """A keyword that neither the method nor the cache takes (:func:`make_config`). The message names the method's
    parameters, then the cache's own settings by their Python names; :attr:`method_message` is the method's part
    alone, for a caller that spells the cache's settings its own way (``kvq generate``'s options)."""

    def __init__(self, method_message: str, settings: list[str]) -> None:
        super().__init__(f"{method_message}; the cache's own settings: {', '.join(settings)}")
        self.method_message = method_message


def _method_string_kwargs(method: str, given: dict, params: dict) -> dict:
    """The arguments of :func:`make_config` that the method string ``method`` (``"qjl+affine:4"``) stands for
    (:meth:`~kvq.cache.method_string.MethodSpec.cache_kwargs`), merged with those given beside it (``given``: the
    keyword arguments, ``params``: the shared parameters). A keyword may repeat what the string sets, not
    contradict it; the string's bracketed ``sinks``, ``window`` and ``flush`` replace those keywords' defaults
    (read from :func:`make_config`'s signature), so a keyword given at its default value does not count as given.

    :raises ValueError: the string does not parse (the grammar is shown); it names mlx-lm's own caches
        (``kvcache``, ``mlx-affine``); ``key_method``/``value_method`` are given too; a parameter or cache option
        is set in the string and, to another value, as a keyword (``"turboquant:3"`` with ``bits=4``).
    """
    spec = parse_method(method.strip())
    if spec.is_reference or MLX_AFFINE in (spec.key_method, spec.value_method):
        raise ValueError(f"method {method!r} is one of mlx-lm's own caches, not a kvq cache: for it call "
                         f"mlx_lm.models.cache.make_prompt_cache (kvq's methods: "
                         f"{', '.join(sorted(registry().methods))})")
    named = [k for k in ("key_method", "value_method") if given[k] is not None]
    if named:
        raise ValueError(f"method {method!r} is a method string that names the methods already; give "
                         f"{' and '.join(named)} with a method's name (method='affine', key_method='qjl') instead")
    defaults = inspect.signature(make_config).parameters
    spelled = spec.cache_kwargs(given["sinks"], given["window"], given["flush"])

    def refuse_other(name: str, ours, theirs) -> None:
        if theirs != ours:
            raise ValueError(f"method {method!r} sets {name}={ours!r}; got {name}={theirs!r} as well (give the "
                             f"method's name, {spec.key_method!r}, to set it by keyword)")

    for name, value in spec.cache_options.items():  # sinks, window, flush; a budget's bits
        if name == "bits":
            if "bits" in params:
                refuse_other("bits", value, params["bits"])
        elif given[name] != defaults[name].default:
            refuse_other(name, value, given[name])
    for side in ("key_params", "value_params"):
        extra = given[side] or {}
        for name, value in spelled[side].items():
            for source in (extra, params):
                if name in source:
                    refuse_other(name, value, source[name])
        spelled[side] = {**spelled[side], **extra}
    return {**given, **spelled, **params}


def cache_settings() -> tuple[str, ...]:
    """The cache's own settings: the keyword arguments of :func:`make_config` that are not method parameters, read
    from its signature (the error that names a misspelt one lists them; a method string's brackets take only some,
    :data:`kvq.cache.method_string.CACHE_OPTIONS`)."""
    return tuple(name for name, p in inspect.signature(make_config).parameters.items()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY)


def _cache_settings() -> list[str]:
    """:func:`cache_settings` and :func:`make_prompt_cache`'s own, for the error that names a misspelt one."""
    return [*cache_settings(), "max_kv_size (make_prompt_cache)"]


def check_required_kernels(config: CacheConfig, num_kv_heads: int, head_dim: int, num_q_heads: int) -> None:
    """For ``kernels="require"``: raise now, at construction, if no kernel serves decode attention (and, where
    the method has quantize kernels, quantize) on the default device for this model's shapes.

    :raises ValueError: naming the method, op, device and what is installed (see :func:`kvq.select`).
    """
    if config.kernels != "require":
        return
    kp, vp = config.key_params, config.value_params
    if kp.method != vp.method:
        raise ValueError(f"kernels='require': the fused kernels attend keys and values of one method; got "
                         f"key method {kp.method!r} and value method {vp.method!r}")
    shape = (1, num_kv_heads, 4096, head_dim)
    select(kp.method, shape, op="attend", params=kp, num_q_heads=num_q_heads, kernels="require")
    for params in (kp, vp):
        select(params.method, shape, op="quantize", params=params,
               kernels=quantize_kernels(params.method, "require"))


def make_prompt_cache(model, method: str | None = "affine", *, max_kv_size: int | None = None,
                      **kwargs: Any) -> list:
    """One kvq cache per attention layer of an mlx-lm model (drop-in for ``mlx_lm``'s function), on one process or
    on each rank of a model that mlx-lm sharded.

    A layer whose model-made cache is a plain ``KVCache`` gets a :class:`KVQCache`; one whose cache is mlx-lm's
    ``RotatingKVCache(max_size, keep)`` (sliding-window layers) gets a :class:`RotatingKVQCache` with the same
    ``max_size`` and ``keep`` (its ``keep`` tokens, not ``sinks``, stay uncompressed); other caches (SSM state) are
    kept. With ``max_kv_size``, the plain layers get ``RotatingKVQCache(max_size=max_kv_size, keep=4)``, what
    mlx-lm's ``make_prompt_cache`` gives a model without ``make_cache``. A model whose attention cannot use kvq's
    caches (it handles keys and values itself: :mod:`kvq.cache.servable`, probed once per model class and settings) keeps
    mlx-lm's caches, with an :class:`UnservableModelWarning` naming the error. Layer ``i`` of ``model.layers`` gets
    ``config.for_layer(first + i)``, where ``first`` is the index of this
    rank's first layer in the whole model (:func:`~kvq.cache.sharding.first_layer`: 0 unless pipeline parallel),
    so parameters with per-layer state (:class:`kvq.contract.ForLayer`, VecInfer's codebooks) are bound to their
    layer. On a tensor-parallel model the configuration is also ``for_heads(start, stop)`` for this rank's KV heads
    (:func:`~kvq.cache.sharding.kv_head_range`, :class:`kvq.contract.ForHeads`). Also patches mlx-lm's attention
    (:mod:`kvq.cache.patch`) and registers kvq's classes with mlx-lm (:func:`register_with_mlx_lm`).

    :param model: an mlx-lm model (``model.layers``; ``model.make_cache`` is used when present).
    :param method, kwargs: as :func:`make_config`: a method's name with its parameters (``"turboquant", bits=4``,
        ``key_params=``, ``sinks=``, ``window=``, ``kernels=`` ...) or a method string (``"turboquant:4"``,
        ``"qjl+affine:4"``).
    :param max_kv_size: as mlx-lm's: at most this many tokens visible per layer (``None``: unbounded).
    :returns: a list with one cache per layer of ``model.layers``: :class:`KVQCache`, :class:`RotatingKVQCache`,
        or the model's own cache where a layer's is neither mlx-lm's ``KVCache`` nor ``RotatingKVCache``.
    :raises TypeError: ``model`` is not an mlx-lm model (no ``layers``, no ``make_cache``).
    :raises ValueError: bad method/parameters, ``max_kv_size`` not an int above 4, a head_dim the method does not
        support (named), parameters whose ``check_ready()`` fails (:class:`kvq.contract.ChecksReady`: a missing
        VecInfer calibration names the command to run), a tensor-parallel split that leaves a rank part of a KV
        head, or ``kernels="require"`` where no kernel serves this model's decode attention on this device.
    """
    if not hasattr(model, "layers") and not callable(getattr(model, "make_cache", None)):
        raise TypeError(f"model must be an mlx-lm model (with .layers, or make_cache()), e.g. from mlx_lm.load or "
                        f"kvq.models.load; got {type(model).__name__}")
    heads = kv_head_range(model)  # a bad tensor-parallel split is named before anything else
    if max_kv_size is not None and (not isinstance(max_kv_size, int) or max_kv_size <= 4):
        raise ValueError(f"max_kv_size must be an int above 4 (mlx-lm keeps the first 4 tokens); got {max_kv_size!r}")
    config = make_config(method, **kwargs)
    dims = head_dims(model)
    if dims is not None:
        config = config.within_budget(*dims)  # a bits budget's settings, chosen now that head_dims are known
    _check_model(config, model)
    _patch.patch()
    register_with_mlx_lm()
    first = first_layer(model)

    def layer_cache(i: int, made, still: tuple | None) -> KVQCache:
        layer = attrs.evolve(config.for_layer(first + i), still_channels=still)
        layer = layer if heads is None else layer.for_heads(*heads)
        if type(made) is mlx_cache.RotatingKVCache:
            return RotatingKVQCache(layer, made.max_size, made.keep)
        return KVQCache(layer) if max_kv_size is None else RotatingKVQCache(layer, max_kv_size, keep=4)

    def mlx_caches() -> list:  # a patched model's own caches, not the patch's (which calls this function)
        return _patch.mlx_lm_caches(model)

    def kvq_caches() -> list:
        made = mlx_caches()
        # each layer's still key channels (kvq.cache.still), over the tokens its cache can hold
        still = layer_still_channels(model, [_horizon(c, max_kv_size) for c in made])
        return [layer_cache(i, c, still[i]) if type(c) in (mlx_cache.KVCache, mlx_cache.RotatingKVCache) else c
                for i, c in enumerate(made)]

    if heads is None and first == 0:  # (a sharded model's forward pass talks to other ranks: not probed)
        reason = unservable_reason(model, kvq_caches, mlx_caches, settings=(config, max_kv_size))
        if reason is not None:
            model_type = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
            warnings.warn(f"kvq cannot serve the attention of this model ({model_type}: with kvq's caches its "
                          f"forward pass raises {reason}); its layers keep mlx-lm's caches, uncompressed",
                          UnservableModelWarning, stacklevel=2)
            return mlx_caches()
    return kvq_caches()


def _horizon(made, max_kv_size: int | None) -> int | None:
    """The most tokens a layer whose model-made cache is ``made`` can hold (a sliding window's size, ``max_kv_size``;
    0: the model's context length), or ``None`` for a cache kvq does not replace."""
    if type(made) is mlx_cache.RotatingKVCache:
        return made.max_size
    if type(made) is mlx_cache.KVCache:
        return max_kv_size or 0
    return None


def _check_model(config: CacheConfig, model) -> None:
    """What :func:`make_prompt_cache` checks before making caches: head_dims, readiness, required kernels."""
    dims = head_dims(model)
    if dims is not None:
        config.key_params.check_head_dim(dims[0])
        config.value_params.check_head_dim(dims[1])
    for params in (config.key_params, config.value_params):
        check_ready = optional_hook(params, ChecksReady)  # e.g. VecInfer: its calibration exists and reads
        if check_ready is not None:
            check_ready()
    heads = getattr(getattr(model, "args", None), "num_attention_heads", None)
    if config.kernels == "require" and dims is not None and heads:
        # (a model without mlx-lm's args is checked at its first decode step, where selection raises the same)
        check_required_kernels(config, getattr(model.args, "num_key_value_heads", None) or heads, dims[0], heads)


def patch_model(model, method: str | None = "affine", **kwargs: Any):
    """Make ``model.make_cache()`` return kvq caches (:func:`make_prompt_cache`, so this rank's caches under
    ``mlx.launch``), so ``mlx_lm.server``, ``BatchGenerator`` and ``mlx_lm.generate`` use them.

    Every call of ``make_cache`` builds fresh caches. Returns ``model``. Undo with :func:`unpatch_model`.

    :raises ValueError: as :func:`make_prompt_cache`, now rather than at the first request (caches are made once
        here to check).
    """
    make_prompt_cache(model, method, **kwargs)  # fail now, not at the first request
    if not hasattr(model, "_kvq_original_make_cache"):
        model._kvq_original_make_cache = getattr(model, "make_cache", None)

    def make_cache(max_kv_size: int | None = None) -> list:
        """This model's kvq caches (``max_kv_size``: kvq's replacement of mlx-lm's ``make_prompt_cache`` passes it;
        mlx-lm's own, bound before the patch, calls this without it, and its ``max_kv_size`` is read from that call:
        :func:`kvq.cache.patch.caller_max_kv_size`)."""
        if max_kv_size is None:
            max_kv_size = _patch.caller_max_kv_size()
        return make_prompt_cache(model, method, max_kv_size=max_kv_size, **kwargs)

    model.make_cache = make_cache
    return model


def unpatch_model(model):
    """Undo :func:`patch_model`: ``model.make_cache`` is mlx-lm's again (the model's own, or none where it had
    none); returns ``model``. A model that was not patched is left as it is. mlx-lm's attention stays routed
    through kvq's (:mod:`kvq.cache.patch`), which passes every cache that is not kvq's to mlx-lm's own attention
    unchanged."""
    if hasattr(model, "_kvq_original_make_cache"):
        original = model.__dict__.pop("_kvq_original_make_cache")
        if original is None:
            model.__dict__.pop("make_cache", None)
        else:
            model.make_cache = original
    return model


__all__ = ["BatchKVQCache", "CacheConfig", "CompressedView", "DEFAULT_FLUSH", "KVQCache", "OutlierLayerWarning",
           "RotatingKVQCache", "UnknownParameterError", "UnservableModelWarning", "load_prompt_cache", "make_config",
           "make_prompt_cache", "prefill_prompt",
           "patch_model", "register_with_mlx_lm", "save_prompt_cache", "unpatch_model"]
