"""kvq caches under MLX distributed, as mlx-lm uses it: tensor- and pipeline-parallel models started by ``mlx.launch``.

kvq adds no distributed layer of its own. mlx-lm shards a model in one of two ways, and kvq's caches follow:

* tensor parallel (``model.shard(group)``): rank ``r`` of ``N`` computes KV heads ``r*H/N : (r+1)*H/N`` (mlx's
  ``shard_linear`` splits ``k_proj``/``v_proj`` rows into ``N`` contiguous parts), so its caches hold
  ``[B, H_kv / N, T, D]``. Random rotations and sketches (TurboQuant, QJL) are drawn from numpy generators seeded
  only by the method's ``seed`` and shared by all heads, so every rank builds the same matrices. Per-head state from
  calibration (VecInfer's smoothing factors and per-head codebooks) is cut to the rank's heads through the
  parameters' ``for_heads(start, stop)`` (duck-typed, like ``for_layer``).
* pipeline parallel (``model.model.pipeline(group)``): each rank holds its own layers; ``model.layers`` lists only
  those, and layer ``i`` of rank ``r`` is layer ``model.model.start_idx + i`` of the model (per-layer calibration
  is bound to that index). Those models assign ``cache[-1].keys = mx.depends(...)``, which
  :attr:`kvq.cache.KVQCache.keys` supports.

    mlx.launch --backend ring -n 2 -- python -m kvq.cli generate --model M --method turboquant --bits 4 --prompt hi

    group = mx.distributed.init()
    model, tokenizer = kvq.distributed.load("path/or/id", pipeline=False)   # or mlx_lm.utils.sharded_load
    cache = kvq.distributed.make_prompt_cache(model, "turboquant", bits=4)

Tensor parallelism needs ``num_kv_heads`` divisible by the group size; mlx-lm itself then fails later with a reshape
error, kvq says so at :func:`shard`/:func:`load` time or at :func:`make_prompt_cache` for a model sharded by mlx-lm.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import attrs
import mlx.core as mx


def _group(group: mx.distributed.Group | None) -> mx.distributed.Group:
    """``group``, or the process group of this launch (``mx.distributed.init()``; size 1 without ``mlx.launch``)."""
    return group if group is not None else mx.distributed.init()


def is_rank0(group: mx.distributed.Group | None = None) -> bool:
    """Whether this process is rank 0 (the one that prints and serves HTTP, as in mlx-lm's chat and server)."""
    return _group(group).rank() == 0


@contextlib.contextmanager
def rank0_stdout(group: mx.distributed.Group | None = None):
    """Within the block, standard output of every rank but 0 goes to ``os.devnull`` (errors still show)."""
    if is_rank0(group):
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


def _heads(model) -> tuple[int, int]:
    """``(num_kv_heads, num_attention_heads)`` of the unsharded model, from ``model.args``."""
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    if not heads:
        raise ValueError(f"cannot read the attention layout of {type(model).__name__} (no args.num_attention_heads)")
    return getattr(args, "num_key_value_heads", None) or heads, heads


def check_tensor_parallel(num_kv_heads: int, num_attention_heads: int, group_size: int) -> None:
    """Raise unless a model with these head counts (its config's ``num_key_value_heads`` and
    ``num_attention_heads``) can be split over ``group_size`` tensor-parallel ranks.

    :raises ValueError: ``num_kv_heads`` or ``num_attention_heads`` not divisible by ``group_size`` (mlx-lm would
        shard the model anyway and then fail in a reshape, or silently mix heads), naming both numbers.
    """
    kv_heads, heads = num_kv_heads, num_attention_heads
    if kv_heads % group_size or heads % group_size:
        fits = [n for n in range(1, kv_heads + 1) if kv_heads % n == 0 and heads % n == 0]
        raise ValueError(f"tensor parallel: the model has num_kv_heads={kv_heads} (num_attention_heads={heads}), "
                         f"which the group size {group_size} does not divide: each rank must hold whole KV heads. "
                         f"Use a group size in {fits}, or pipeline parallelism")


def shard(model, group: mx.distributed.Group | None = None, *, pipeline: bool = False):
    """Shard ``model`` in place as ``mlx_lm.utils.sharded_load`` does, after kvq's checks; returns ``model``.

    :param group: the ranks to shard over (default: this launch's group). A group of size 1 leaves it as is.
    :param pipeline: ``model.model.pipeline(group)`` (each rank its own layers) instead of ``model.shard(group)``.
    :raises ValueError: the model type has no such mode in mlx-lm, too few KV heads (:func:`check_tensor_parallel`)
        or layers for the group size.
    """
    g = _group(group)
    N = g.size()
    if N == 1:
        return model
    if pipeline:
        if not hasattr(getattr(model, "model", None), "pipeline"):
            raise ValueError(f"pipeline parallel: mlx-lm's {type(model).__module__} has no model.model.pipeline; "
                             "use tensor parallelism")
        if len(model.model.layers) < N:
            raise ValueError(f"pipeline parallel: {len(model.model.layers)} layers cannot be split over {N} ranks")
        model.model.pipeline(g)
    else:
        if not hasattr(model, "shard"):
            raise ValueError(f"tensor parallel: mlx-lm's {type(model).__module__} has no model.shard; use "
                             "pipeline parallelism")
        check_tensor_parallel(*_heads(model), N)
        model.shard(g)
    mx.eval(model.parameters())
    barrier(g)
    return model


def barrier(group: mx.distributed.Group) -> None:
    """Wait until every rank of ``group`` gets here (an all-sum of one number), as mlx-lm's ``sharded_load``
    does. The ring back end reduces on the CPU stream (mlx-lm's choice); NCCL has no CPU stream, so where the
    CPU stream fails the default stream is used."""
    try:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=group))
    except RuntimeError:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))


def load(name_or_path=None, *, pipeline: bool = False, group: mx.distributed.Group | None = None,
         progress: bool = True):
    """``(model, tokenizer)`` for this rank: :func:`kvq.models.load` names, sharded by :func:`shard`.

    Every rank resolves the model (the default model, a folder, a GGUF file or a Hub id: see
    :func:`kvq.models.resolve_model`), loads it lazily and keeps only its shard. Unlike
    ``mlx_lm.utils.sharded_load`` it needs no ``model.safetensors.index.json``, but fetches a Hub model whole.

    :raises kvq.models.ModelError: the model cannot be resolved or loaded. :raises ValueError: as :func:`shard`.
    """
    from . import models

    g = _group(group)
    if g.size() == 1:
        return models.load(name_or_path, progress=progress)
    from mlx_lm.utils import load_model, load_tokenizer

    path = models.resolve_model(name_or_path, progress=progress and g.rank() == 0)
    try:
        model, config = load_model(path, lazy=True, strict=False)
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except (OSError, ValueError, KeyError) as error:
        raise models.ModelError(f"mlx-lm cannot load {path}: {error}") from error
    return shard(model, g, pipeline=pipeline), tokenizer


def kv_head_range(model) -> tuple[int, int] | None:
    """``(start, stop)``: the KV heads of the unsharded model that this rank's attention computes, or ``None``
    when the model is not tensor-sharded (its attention layers' ``k_proj`` have no ``group``).

    :raises ValueError: the model was sharded over more ranks than it has KV heads, or over a group size that does
        not divide them (mlx-lm's ``model.shard`` allows it; its attention then fails or mixes heads).
    """
    attention = next((layer.self_attn for layer in getattr(model, "layers", ())
                      if layer is not None and hasattr(getattr(layer, "self_attn", None), "k_proj")), None)
    g = getattr(getattr(attention, "k_proj", None), "group", None)
    if g is None:
        return None
    kv_heads, _ = _heads(model)
    N, r = g.size(), g.rank()
    check_tensor_parallel(*_heads(model), N)
    return r * kv_heads // N, (r + 1) * kv_heads // N


def first_layer(model) -> int:
    """Index in the whole model of ``model.layers[0]``: ``model.model.start_idx`` when pipelined, else 0."""
    return int(getattr(getattr(model, "model", None), "start_idx", 0) or 0)


def _for_heads(params, heads):
    hook = getattr(params, "for_heads", None)
    return params if heads is None or hook is None else hook(*heads)


def make_prompt_cache(model, method: str | None = "affine", **kwargs: Any) -> list:
    """:func:`kvq.make_prompt_cache` for a model sharded by mlx-lm (and the same on an unsharded one).

    Each kvq cache gets ``config.for_layer(first_layer(model) + i)`` (pipeline: the layer's index in the whole
    model) and, under tensor parallelism, parameters ``for_heads(start, stop)`` for this rank's KV heads (methods
    without per-head state have no ``for_heads`` and are unchanged). Caches of other layer kinds are kept.

    :param model, method, kwargs: as :func:`kvq.make_prompt_cache`.
    :raises ValueError: as :func:`kvq.make_prompt_cache`, or as :func:`kv_head_range` (too few KV heads).
    """
    from .cache import KVQCache, make_config
    from .cache import make_prompt_cache as make_caches

    heads = kv_head_range(model)
    caches = make_caches(model, method, **kwargs)
    config, first = make_config(method, **kwargs), first_layer(model)
    if heads is None and first == 0:
        return caches
    out = []
    for i, cache in enumerate(caches):
        if isinstance(cache, KVQCache):
            layer = config.for_layer(first + i)
            cache = KVQCache(attrs.evolve(layer, key_params=_for_heads(layer.key_params, heads),
                                          value_params=_for_heads(layer.value_params, heads)))
        out.append(cache)
    return out


def patch_model(model, method: str | None = "affine", **kwargs: Any):
    """:func:`kvq.patch_model` with :func:`make_prompt_cache`: ``model.make_cache()`` (``mlx_lm.server``,
    ``BatchGenerator``) returns this rank's kvq caches. Undo with :func:`kvq.unpatch_model`. Returns ``model``.

    :raises ValueError: bad method or parameters, or too few KV heads, now rather than at the first request.
    """
    from .cache import patch_model as patch

    patch(model, method, **kwargs)
    model.make_cache = lambda: make_prompt_cache(model, method, **kwargs)
    model.make_cache()
    return model


__all__ = ["barrier", "check_tensor_parallel", "first_layer", "is_rank0", "kv_head_range", "load",
           "make_prompt_cache", "patch_model", "rank0_stdout", "shard"]
