"""A bits budget: ``bits=3.5`` (method string ``turboquant:3.5``) picks each layer's key and value settings.

A user with a memory target gives the bits per coordinate the compressed tokens may take, not a setting of the
method: ``kvq.make_prompt_cache(model, "turboquant", bits=3.5)``. Each layer spends that budget on its keys and
values at its own head_dims, among the settings the method offers (:class:`kvq.contract.SpendsBudget`: TurboQuant's
whole bits and, between them, shares of rotated coordinates one bit wider), counted as
:class:`kvq.BitsAccounting` counts them: every bit stored per token (codes in whole packed words, norms), so the
budget holds for the bytes the cache really allocates. Data stored once per layer (rotation tables, a centred
layer's key mean: 32 bits per channel and head, ``32 / T`` bits per key coordinate for ``T`` tokens) is not per
token and not in the budget; ``kvq eval`` reports it in the effective bits.

The rule, per layer: the pair of settings ``(keys, values)`` whose bits per coordinate, averaged over both sides'
coordinates, are the most that fit the budget; among those, the pair whose keys hold closest to
:data:`KEY_LEAD` more bits than its values; then the one with more key bits. Keys lead because attention
multiplies their error by the query and exponentiates it (a key error moves every weight; a value error is
averaged by the weights): KIVI (arXiv 2402.02750) and KVQuant (arXiv 2401.18079) quantize keys more finely for
that reason, and on gemma-3-270m turboquant keys at 4 bits with values at 3 found 3/3 needles where 3 bits on
both sides found none (kvq issue #53; ``benchmarks/results/eval/2026-12-05-gemma-3-270m-2k-*``).

The choice depends only on the budget, the method's parameters and the head_dims, never on data: a prompt gives the
same settings whatever its chunking, every row of a batch has the same settings (so rows pack together), and a
prompt-cache file holds the settings chosen. :func:`kvq.make_prompt_cache` chooses at construction (the model
names its head_dims); a cache built from a :class:`~kvq.cache.CacheConfig` alone chooses at its first update. The
outlier-layer guard (:mod:`kvq.cache.guard`) may still store a layer with affine 8-bit afterwards, outside the
budget, with its warning.
"""

from __future__ import annotations

import math

from ..contract import SpendsBudget, optional_hook

#: Bits per coordinate the keys should hold above the values, where the method's settings allow.
KEY_LEAD = 1.0
#: How far above the most the methods can store a budget may be (it then buys the most); further is refused.
BEYOND = 1.0


def check_budget(bits) -> float:
    """Check a budget in bits per coordinate (keys and values together, per token).

    :return: ``bits`` as a float. :raises ValueError: not a finite number above 0 (the message names ``bits``).
    """
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not math.isfinite(bits) or bits <= 0:
        raise ValueError(f"bits must be a number above 0 (a budget in bits per coordinate, e.g. 3.5); got {bits!r}")
    return float(bits)


def spender(params):
    """The method's list of settings a budget may choose from: ``params.budget_options``, a callable
    ``(head_dim) -> [params, ...]`` (:class:`kvq.contract.SpendsBudget`).

    :raises ValueError: the method offers no settings for a budget (the message names it).
    """
    hook = optional_hook(params, SpendsBudget)
    if hook is None:
        raise ValueError(f"{params.method} takes whole bits only (it offers no settings for a bits budget); give "
                         f"an integer bits, or a method that does (turboquant)")
    return hook


def options(params, head_dim: int) -> list:
    """The settings of ``params``' method a budget may pick at ``head_dim`` (``params.budget_options``).

    :raises ValueError: as :func:`spender`, or a ``head_dim`` the method does not serve.
    """
    return list(spender(params)(head_dim))


def spend(budget: float, key_params, value_params, head_dims: tuple[int, int]) -> tuple:
    """The settings ``(key_params, value_params)`` a layer with head_dims ``(D_k, D_v)`` stores with ``budget``
    bits per coordinate (the module's rule), drawn from :func:`options` of the given parameters.

    :raises ValueError: a method without budget options, a budget below the fewest bits the two methods can
        store at these head_dims, or more than :data:`BEYOND` bits above the most they can store (a budget just
        above it buys the most; far above it, such as ``bits=9.5`` for TurboQuant's 4.25, it is a mistake, as
        ``bits=5`` is; the messages name both methods and the bound).
    """
    budget = check_budget(budget)
    dk, dv = head_dims
    keys = [(p.accounting(dk).bits_per_coordinate, p) for p in options(key_params, dk)]
    values = [(p.accounting(dv).bits_per_coordinate, p) for p in options(value_params, dv)]
    most = (max(b for b, _ in keys) * dk + max(b for b, _ in values) * dv) / (dk + dv)
    if budget > most + BEYOND:
        raise ValueError(f"bits budget {budget:g} is more than {BEYOND:g} bit above the most bits per coordinate "
                         f"{key_params.method} keys and {value_params.method} values store at head_dims ({dk}, "
                         f"{dv}): {most:g}; a budget is the most the cache may spend, so give at most {most:g} "
                         f"(or whole bits)")
    best, best_rank = None, None
    for kb, kp in keys:
        for vb, vp in values:
            mean = (kb * dk + vb * dv) / (dk + dv)
            if mean > budget + 1e-9:
                continue
            rank = (mean, -abs(kb - vb - KEY_LEAD), kb)
            if best_rank is None or rank > best_rank:
                best, best_rank = (kp, vp), rank
    if best is None:
        least = (min(b for b, _ in keys) * dk + min(b for b, _ in values) * dv) / (dk + dv)
        raise ValueError(f"bits budget {budget:g} is below the fewest bits per coordinate {key_params.method} keys "
                         f"and {value_params.method} values store at head_dims ({dk}, {dv}): {least:g}")
    return best
