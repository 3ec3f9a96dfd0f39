"""Input checks shared by every method: each error names the argument and what is allowed."""

from __future__ import annotations

from typing import Iterable

import mlx.core as mx

FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def one_of(name: str, value, allowed: Iterable, owner: str | None = None) -> None:
    """Raise ``ValueError`` unless ``value`` is in ``allowed``; the message names ``name`` (after ``owner``, the
    method whose parameter it is, where given) and ``allowed``, and says so where ``value`` is text among numbers
    (``bits="4"``, as a config file may give it: ``"4"`` is not ``4``)."""
    allowed = tuple(allowed)
    if value not in allowed:
        shown = ", ".join(str(a) for a in allowed)
        text = isinstance(value, str) and not any(isinstance(a, str) for a in allowed)
        raise ValueError(f"{owner + ' ' if owner else ''}{name} must be one of {shown}; got {value!r}"
                         + ("; that is text, not a number" if text else ""))


def attrs_one_of(allowed: Iterable):
    """An attrs validator wrapping :func:`one_of` (the field name is the argument name; the instance's ``method``,
    a parameters class's, names the method)."""
    allowed = tuple(allowed)

    def validator(instance, attribute, value):
        owner = getattr(type(instance), "method", None)
        one_of(attribute.name, value, allowed, owner if isinstance(owner, str) else None)

    return validator


def float_array(name: str, x, ndim: int | None = 4) -> mx.array:
    """Check that ``x`` is a floating ``mx.array`` of rank ``ndim``; return it.

    :raises TypeError: not an ``mx.array``, or not float16/bfloat16/float32.
    :raises ValueError: wrong rank (the message gives the expected layout).
    """
    if not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mx.array, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype float16, bfloat16 or float32; got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        layout = "[B, H, T, D]" if ndim == 4 else f"rank {ndim}"
        raise ValueError(f"{name} must have rank {ndim} ({layout}); got shape {tuple(x.shape)}")
    return x


def head_dim_multiple(name: str, head_dim: int, multiple: int, why: str) -> None:
    """Raise ``ValueError`` unless ``head_dim`` is a positive multiple of ``multiple``."""
    if head_dim < 1 or head_dim % multiple:
        raise ValueError(f"{name}: head_dim {head_dim} is not supported: it must be a multiple of {multiple} ({why})")
