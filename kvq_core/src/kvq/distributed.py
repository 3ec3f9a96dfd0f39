"""kvq caches under MLX distributed, as mlx-lm uses it: tensor- and pipeline-parallel models started by ``mlx.launch``.

kvq adds no distributed layer of its own. mlx-lm shards a model in one of two ways, and kvq's caches follow:

* tensor parallel (``model.shard(group)``): rank ``r`` of ``N`` computes KV heads ``r*H/N : (r+1)*H/N`` (mlx's
  ``shard_linear`` splits ``k_proj``/``v_proj`` rows into ``N`` contiguous parts), so its caches hold
  ``[B, H_kv / N, T, D]``. Random rotations and sketches (TurboQuant, QJL) are drawn from numpy generators seeded
  only by the method's ``seed`` and shared by all heads, so every rank builds the same matrices. Per-head state
  (VecInfer's smoothing factors and per-head codebooks, TurboQuant's fitted outlier channels) is cut to the rank's
  heads through the parameters' optional ``for_heads(start, stop)`` (:class:`kvq.contract.ForHeads`).
* pipeline parallel (``model.model.pipeline(group)``): each rank holds its own layers; ``model.layers`` lists only
  those, and layer ``i`` of rank ``r`` is layer ``model.model.start_idx + i`` of the model (per-layer calibration
  is bound to that index). Those models assign ``cache[-1].keys = mx.depends(...)``, which
  :attr:`kvq.cache.KVQCache.keys` supports.

:func:`kvq.make_prompt_cache` reads both from the model (:mod:`kvq.cache.sharding`: :func:`kv_head_range`,
:func:`first_layer`), so the same call serves one process and every rank:

    mlx.launch --backend ring -n 2 -- python -m kvq.cli generate --model M --method turboquant --bits 4 --prompt hi

    group = mx.distributed.init()
    model, tokenizer = kvq.distributed.load("path/or/id", pipeline=False)   # or mlx_lm.utils.sharded_load
    cache = kvq.make_prompt_cache(model, "turboquant", bits=4)

Tensor parallelism needs ``num_kv_heads`` divisible by the number of ranks; mlx-lm itself then fails later with a
reshape error, kvq says so at :func:`shard`/:func:`load` time or at :func:`kvq.make_prompt_cache` for a model
sharded by mlx-lm.
"""

from __future__ import annotations

import contextlib
import os

import mlx.core as mx

from .cache.sharding import check_tensor_parallel, first_layer, kv_head_range, model_heads


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
            raise ValueError(f"pipeline parallel: mlx-lm's {type(model).__module__} has no model.model.pipeline "
                             "(mlx-lm pipelines some architectures only); use tensor parallelism, with a number of "
                             "ranks that divides the model's KV heads")
        if len(model.model.layers) < N:
            raise ValueError(f"pipeline parallel: {len(model.model.layers)} layers cannot be split over {N} ranks")
        model.model.pipeline(g)
    else:
        if not hasattr(model, "shard"):
            raise ValueError(f"tensor parallel: mlx-lm's {type(model).__module__} has no model.shard; use "
                             "pipeline parallelism")
        check_tensor_parallel(*model_heads(model), N)
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


# check_tensor_parallel, first_layer, kv_head_range: from kvq.cache.sharding, which kvq.make_prompt_cache uses
__all__ = ["barrier", "check_tensor_parallel", "first_layer", "is_rank0", "kv_head_range", "load", "rank0_stdout",
           "shard"]
