"""``CacheConfig``: what one layer of a kvq cache stores and how (methods and parameters, sinks, residual window,
flush, kernel and outlier-layer preferences)."""

from __future__ import annotations

import math
from typing import Any

import attrs

from ..contract import EncodesBlocks, ForHeads, ForLayer, optional_hook
from ..defaults import DEFAULT_FLUSH, DEFAULT_SINKS, DEFAULT_WINDOW
from ..selection import check_kernels
from .budget import check_budget, spend
from .guard import check_policy


@attrs.frozen
class CacheConfig:
    """What a layer stores and how: key and value methods with their parameters, sinks and window sizes.

    :param key_params: parameter object of the keys' method (``key_params.method`` names it).
    :param value_params: parameter object of the values' method.
    :param sinks: first tokens kept uncompressed (>= 0; default 4).
    :param window: most recent tokens kept uncompressed (>= 0; default 128).
    :param step: tokens per allocation step of the compressed store.
    :param flush: tokens leave the window for the compressed store in blocks of ``flush`` (>= 1; default
        :data:`DEFAULT_FLUSH`, 128):
        the window then holds ``window`` to ``window + flush - 1`` tokens. A block (KIVI's residual, arXiv
        2402.02750, flushes whole groups) quantizes once every ``flush`` steps, so a decode step is an append and
        one launch; a step that compresses costs several times more on the host (on an H200 at 32K: 14 ms of
        graph building against 4, ``benchmarks/results/host/README.md``). 1 compresses one token every decode
        step (the window then holds exactly ``window`` tokens).
    :param kernels: ``"auto"`` (default), ``"require"`` or ``"off"`` (:data:`kvq.selection.KERNELS`): which
        implementations the cache's hot path may use. ``require``: attention must run in a kernel (checked by
        :func:`kvq.make_prompt_cache` at construction) and quantize runs in a kernel wherever the method has
        one. A run-time preference of this process: it is not written to prompt-cache files.
    :param outlier_layers: ``"upgrade"`` (default), ``"warn"`` or ``"off"``: what the layer does when the keys of
        the first block it compresses show outlier channels that low-bit keys cannot hold
        (:mod:`kvq.cache.guard`: stored with affine 8-bit instead, with a warning; warn only; nothing). A run-time
        preference, not written to prompt-cache files (the parameters a layer ends up with are).
    :param layer: the layer's index in the model (set by :meth:`for_layer`; named in warnings), or ``None``; not
        compared (two layers' equal configurations are equal).
    :param outlier_layer: set by the guard when this layer's first compressed block showed outlier channels
        (whatever the policy did about it); written to prompt-cache files.
    :param still_channels: the key channels the layer's RoPE keeps still over the tokens it can hold (ascending;
        :mod:`kvq.cache.still`, set by :func:`kvq.make_prompt_cache` from the model), the only ones a centred layer
        subtracts a mean from (:mod:`kvq.cache.guard`); ``None``: unknown (the guard's whole-mean rule). A property
        of the model, not a setting: not compared (packed rows compare it where it still matters, before a row's
        first compression: :func:`kvq.cache.packable._same_settings`).
    :param budget: bits per coordinate the layer's keys and values may store together (:mod:`kvq.cache.budget`),
        or ``None``: the parameters are used as given. With a budget, :meth:`within_budget` replaces both sides'
        parameters by the settings the budget buys at the layer's head_dims (once they are known); written to
        prompt-cache files with the settings chosen.
    """

    key_params: Any
    value_params: Any
    sinks: int = attrs.field(default=DEFAULT_SINKS)
    window: int = attrs.field(default=DEFAULT_WINDOW)
    step: int = attrs.field(default=256)
    kernels: str = attrs.field(default="auto", validator=lambda i, a, v: check_kernels(v))
    flush: int = attrs.field(default=DEFAULT_FLUSH)
    outlier_layers: str = attrs.field(default="upgrade", validator=lambda i, a, v: check_policy(v))
    layer: int | None = attrs.field(default=None, eq=False)
    outlier_layer: bool = attrs.field(default=False)
    budget: float | None = attrs.field(default=None)
    still_channels: tuple | None = attrs.field(default=None, converter=lambda v: None if v is None else tuple(v),
                                               repr=lambda v: "None" if v is None else f"<{len(v)} channels>",
                                               eq=False)

    @budget.validator
    def _budget(self, attribute, value):
        if value is not None:
            check_budget(value)

    @flush.validator
    @sinks.validator
    @window.validator
    @step.validator
    def _non_negative(self, attribute, value):
        low = 1 if attribute.name in ("step", "flush") else 0
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{attribute.name} must be an int >= {low}; got {value!r}")

    @property
    def flush_tokens(self) -> int:
        """Tokens per compression: ``flush``, made a multiple of both sides' block (:class:`kvq.contract.
        EncodesBlocks`, e.g. QJL's outlier groups) by taking their least common multiple. The window holds
        ``window`` to ``window + flush_tokens - 1`` tokens."""
        blocks = [self.flush]
        for params in (self.key_params, self.value_params):
            hook = optional_hook(params, EncodesBlocks)
            if hook is not None:
                blocks.append(hook())
        return math.lcm(*blocks)

    def within_budget(self, key_head_dim: int, value_head_dim: int) -> "CacheConfig":
        """This configuration with the settings :attr:`budget` buys at these head_dims
        (:func:`kvq.cache.budget.spend`; ``self`` without a budget). The same head_dims give the same settings, so
        calling it again changes nothing. :raises ValueError: as :func:`~kvq.cache.budget.spend`."""
        if self.budget is None:
            return self
        kp, vp = spend(self.budget, self.key_params, self.value_params, (key_head_dim, value_head_dim))
        return attrs.evolve(self, key_params=kp, value_params=vp)

    def for_layer(self, layer: int) -> "CacheConfig":
        """This configuration for layer ``layer`` (its index in the whole model): parameters with the optional
        ``for_layer`` (:class:`kvq.contract.ForLayer`: per-layer calibration such as VecInfer's codebooks) are
        specialised; the others are shared."""
        return attrs.evolve(self._specialised(ForLayer, layer), layer=layer)

    def for_heads(self, start: int, stop: int) -> "CacheConfig":
        """This configuration for a cache holding KV heads ``start:stop`` of the model (one tensor-parallel rank's):
        parameters with the optional ``for_heads`` (:class:`kvq.contract.ForHeads`: per-head state) are
        specialised; the others are shared."""
        return self._specialised(ForHeads, start, stop)

    def _specialised(self, protocol, *args) -> "CacheConfig":
        def specialise(params):
            hook = optional_hook(params, protocol)
            return params if hook is None else hook(*args)

        return attrs.evolve(self, key_params=specialise(self.key_params), value_params=specialise(self.value_params))

    def check_head_dim(self, head_dim: int) -> None:
        """:raises ValueError: a head_dim that the key or value method does not support."""
        self.key_params.check_head_dim(head_dim)
        self.value_params.check_head_dim(head_dim)

    def holds_kv_bits(self, bits: int, group_size: int, head_dims: tuple) -> bool:
        """Whether a layer of this configuration already holds what mlx-lm's ``kv_bits``/``kv_group_size`` ask for:
        keys and values both of kvq's ``affine`` method with these ``bits`` and ``group_size`` (a group size left to
        be chosen from head_dim is the choice for ``head_dims``, ``(D_k, D_v)`` or ``(None, None)``)."""
        return all(p.method == "affine" and (p.bits, _group_size(p, d)) == (bits, group_size)
                   for p, d in zip((self.key_params, self.value_params), head_dims))


def _group_size(params, head_dim: int | None):
    """The group size affine ``params`` quantize ``head_dim``-wide vectors with: their ``group_size``, or where that
    is left to be chosen from head_dim (``None``), the choice (``group_size_for``) once head_dim is known."""
    choose = getattr(params, "group_size_for", None)
    if params.group_size is None and choose is not None and head_dim is not None:
        return choose(head_dim)
    return params.group_size
