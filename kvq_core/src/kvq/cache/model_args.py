"""What kvq reads from an mlx-lm model's ``args`` (its ``ModelArgs``), in one place."""

from __future__ import annotations


def head_dims(model) -> tuple[int, int] | None:
    """``(D_k, D_v)`` of an mlx-lm ``model``'s attention: ``args.head_dim`` (else ``hidden_size //
    num_attention_heads``) for keys, ``args.v_head_dim`` where the model has one (DeepSeek's MLA) else the same for
    values; ``None`` where the model has no ``args`` or they name neither."""
    args = getattr(model, "args", None)
    if args is None:
        return None
    heads = getattr(args, "num_attention_heads", None)
    head_dim = getattr(args, "head_dim", None) or (heads and getattr(args, "hidden_size", 0) // heads)
    return (head_dim, getattr(args, "v_head_dim", None) or head_dim) if head_dim else None
