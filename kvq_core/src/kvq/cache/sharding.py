"""What a model sharded by mlx-lm means for its caches: which layers and KV heads this rank holds.

mlx-lm shards a model in one of two ways (``mlx_lm.utils.sharded_load``, or :func:`kvq.distributed.shard`):

* tensor parallel (``model.shard(group)``): rank ``r`` of ``N`` computes KV heads ``r*H/N : (r+1)*H/N`` (mlx's
  ``shard_linear`` splits ``k_proj``/``v_proj`` rows into ``N`` contiguous parts), so its caches hold
  ``[B, H_kv / N, T, D]``: :func:`kv_head_range`.
* pipeline parallel (``model.model.pipeline(group)``): each rank holds its own layers; ``model.layers`` lists only
  those, and layer ``i`` of rank ``r`` is layer ``model.model.start_idx + i`` of the model: :func:`first_layer`.

:func:`kvq.make_prompt_cache` reads both from the model, so the same call makes the right caches on one process
and on every rank. These functions only read the model; they import nothing of MLX's distributed API.
"""

from __future__ import annotations


def model_heads(model) -> tuple[int, int]:
    """``(num_kv_heads, num_attention_heads)`` of the unsharded model, from ``model.args``.

    :raises ValueError: the model has no ``args.num_attention_heads``.
    """
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    if not heads:
        raise ValueError(f"cannot read the attention layout of {type(model).__name__} (no args.num_attention_heads)")
    return getattr(args, "num_key_value_heads", None) or heads, heads


def check_tensor_parallel(num_kv_heads: int, num_attention_heads: int, num_ranks: int) -> None:
    """Raise unless a model with these head counts (its config's ``num_key_value_heads`` and
    ``num_attention_heads``) can be split over ``num_ranks`` tensor-parallel ranks (mlx's ``group.size()``).

    :raises ValueError: ``num_kv_heads`` or ``num_attention_heads`` not divisible by ``num_ranks`` (mlx-lm would
        shard the model anyway and then fail in a reshape, or silently mix heads), naming both numbers.
    """
    kv_heads, heads = num_kv_heads, num_attention_heads
    if kv_heads % num_ranks or heads % num_ranks:
        fits = [n for n in range(1, kv_heads + 1) if kv_heads % n == 0 and heads % n == 0]
        raise ValueError(f"tensor parallel: the model has num_kv_heads={kv_heads} (num_attention_heads={heads}), "
                         f"which the group size {num_ranks} does not divide: each rank must hold whole KV heads. "
                         f"Use a group size (mlx.launch -n) of {', '.join(map(str, fits[:-1]))}"
                         f"{' or ' if len(fits) > 1 else ''}{fits[-1]}, or pipeline parallelism (--pipeline) on a "
                         f"model whose mlx-lm module has it")


def kv_head_range(model) -> tuple[int, int] | None:
    """``(start, stop)``: the KV heads of the unsharded model that this rank's attention computes, or ``None``
    when the model is not tensor-sharded (its attention layers' ``k_proj`` have no ``group``).

    :raises ValueError: the model was sharded over more ranks than it has KV heads, or over a number of ranks that
        does not divide them (mlx-lm's ``model.shard`` allows it; its attention then fails or mixes heads).
    """
    attention = next((layer.self_attn for layer in getattr(model, "layers", ())
                      if layer is not None and hasattr(getattr(layer, "self_attn", None), "k_proj")), None)
    g = getattr(getattr(attention, "k_proj", None), "group", None)
    if g is None:
        return None
    kv_heads, _ = model_heads(model)
    N, r = g.size(), g.rank()
    check_tensor_parallel(*model_heads(model), N)
    return r * kv_heads // N, (r + 1) * kv_heads // N


def first_layer(model) -> int:
    """Index in the whole model of ``model.layers[0]``: ``model.model.start_idx`` when pipelined, else 0."""
    return int(getattr(getattr(model, "model", None), "start_idx", 0) or 0)
