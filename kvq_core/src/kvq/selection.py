"""Selection, behind :func:`kvq.select`: per shape, the implementation of each op that supports the problem at the
lowest cost.

Selection runs once per (method, params, op, shape bucket, dtype, device) and is cached; the returned
:class:`Plan` holds bound callables, so per-token calls go straight to the chosen implementation.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import mlx.core as mx

from . import tuning
from .contract import ChecksReady, ForHeadDim, optional_hook
from .hookspecs import OPS
from .install_hints import install_command
from .problem import Problem, device_kind
from .plugins import registry

_CACHE: dict[tuple, "Plan"] = {}
#: The same plans keyed by :func:`select`'s raw arguments (looked up before any validation; filled only after it).
_FAST: dict[tuple, "Plan"] = {}

#: The three kernel preferences (the seed's ``use_kernels`` flag): ``auto`` ranks kernels and pure MLX by cost
#: (kernels that fail their first-use check disable themselves); ``require`` considers kernel implementations
#: only and raises when none serves; ``off`` considers pure MLX only (parity checks, debugging).
KERNELS = ("auto", "require", "off")

#: Most queries per sequence that the fused decode-attention kernels serve (decode, speculative decoding);
#: longer query blocks (prefill) are the pure-MLX blockwise attention's.
MAX_DECODE_QUERIES = 8


def is_kernel(implementation: Any) -> bool:
    """Whether an implementation is a kernel (any backend other than pure MLX, ``"mlx"``)."""
    return implementation.backend != "mlx"


def check_kernels(kernels: Any) -> str:
    """:raises ValueError: ``kernels`` not one of :data:`KERNELS` (named with the allowed values)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}; got {kernels!r}")
    return kernels


@attrs.frozen
class Candidate:
    """One implementation considered for one op: whether it supports the problem and its estimated cost."""

    backend: str
    supported: bool
    cost: float | None
    note: str = ""


@attrs.frozen
class Choice:
    """The implementation chosen for one op, the candidates considered, and why."""

    op: str
    implementation: Any
    candidates: tuple[Candidate, ...]
    reason: str

    @property
    def backend(self) -> str:
        """The chosen implementation's back end (``"mlx"``, ``"metal"``, ``"cuda"`` ...)."""
        return self.implementation.backend


@attrs.frozen
class Plan:
    """What :func:`select` chose for each op of one method on one shape.

    The hot path uses the bound callables: ``plan.quantize(x, params)``, ``plan.dequantize(enc, dtype)``,
    ``plan.attend(q, k_enc, v_enc, scale, mask)``, ``plan.pack(codes, bits)``, ``plan.unpack(packed, bits,
    count)``; each is ``None`` when no installed implementation serves that op.

    :attr params: the parameters for this shape: defaults that depend on head_dim made concrete
        (:class:`kvq.contract.ForHeadDim`; :attr:`notes` says which).
    :attr not_ready: what the parameters' ``check_ready()`` raised (:class:`kvq.contract.ChecksReady`: VecInfer
        without a calibration), or ``None``; while set, :attr:`quantize` raises it and :meth:`explain` says it.
    :attr notes: how the parameters were made concrete, e.g. ``"group_size: 64 for head_dim 128 (given as None:
        the method's default for the head_dim)"``.
    """

    method: str
    params: Any
    shape: tuple[int, int, int, int]
    dtype: Any
    device: str
    choices: dict[str, Choice]
    not_ready: Exception | None = attrs.field(default=None, eq=False)
    notes: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        """Whether the parameters can encode now (:attr:`not_ready` is ``None``)."""
        return self.not_ready is None

    def _bound(self, op: str, hook: str) -> Callable | None:
        choice = self.choices.get(op)
        return None if choice is None else getattr(choice.implementation, hook)

    @property
    def quantize(self):
        """``kvq_quantize(x, params)`` of the chosen implementation, or ``None``; while the parameters are not
        ready, a function that raises :attr:`not_ready` (before any work). ``x`` ``[B, H_kv, T, D]`` float16,
        bfloat16 or float32 -> :class:`kvq.Encoded` (packed codes and per-token side data, each ``[B, H_kv, T,
        ...]``); raises ``ValueError``/``TypeError`` naming the argument on bad input (:func:`kvq.hookspecs.
        kvq_quantize`, the contract every implementation follows)."""
        if self.not_ready is not None and "quantize" in self.choices:
            return self._raise_not_ready
        return self._bound("quantize", "kvq_quantize")

    def _raise_not_ready(self, *args, **kwargs):
        raise self.not_ready.with_traceback(None) from None  # the cause, not the frames that found it

    @property
    def dequantize(self):
        """``kvq_dequantize(encoded, dtype)`` of the chosen implementation, or ``None``: :class:`kvq.Encoded` ->
        ``[B, H_kv, T, D]`` of ``dtype`` (an estimate for sketch methods such as QJL; :func:`kvq.hookspecs.
        kvq_dequantize`)."""
        return self._bound("dequantize", "kvq_dequantize")

    @property
    def attend(self):
        """``kvq_attend(queries, keys, values, scale, mask)`` of the chosen implementation, or ``None``: queries
        ``[B, H_q, T_q, D]`` (not yet scaled) over :class:`kvq.Encoded` keys ``[B, H_kv, T, D]`` and values
        ``[B, H_kv, T, D_v]``, ``mask`` ``None``, ``"causal"`` or a boolean array broadcastable to ``[B, H_q, T_q,
        T]`` (``True``: may attend) -> ``(out, lse)``: ``out`` float32 ``[B, H_q, T_q, D_v]``, ``lse`` float32
        ``[B, H_q, T_q]`` in natural-log units (:func:`kvq.hookspecs.kvq_attend`; parts merge with
        :func:`kvq.attention.merge_parts`)."""
        return self._bound("attend", "kvq_attend")

    @property
    def pack(self):
        """``kvq_pack(codes, bits)`` of the chosen implementation, or ``None``: unsigned codes ``[..., N]`` below
        ``2**bits`` (bits 1-16) -> uint32 ``[..., ceil(N * bits / 32)]`` (:func:`kvq.hookspecs.kvq_pack`)."""
        return self._bound("pack", "kvq_pack")

    @property
    def unpack(self):
        """``kvq_unpack(packed, bits, count)`` of the chosen implementation, or ``None``: the inverse of
        :attr:`pack`, uint32 ``[..., W]`` -> uint32 codes ``[..., count]`` (:func:`kvq.hookspecs.kvq_unpack`)."""
        return self._bound("pack", "kvq_unpack")

    def explain(self) -> str:
        """A human-readable account of the choice per op."""
        lines = [f"{self.method} {self.params} shape={self.shape} dtype={self.dtype} device={self.device}",
                 _bits_line(self.params, self.shape[3])]
        lines += [f"  ({note})" for note in self.notes]
        if self.not_ready is not None:
            lines.append(f"  NOT READY: {self.not_ready} (quantize raises this)")
        for op in OPS:
            choice = self.choices.get(op)
            if choice is not None:
                lines.append(f"  {op:<10} -> {choice.backend}: {choice.reason}")
            elif op == "attend" and "dequantize" in self.choices:
                lines.append(f"  {op:<10} -> (no implementation installed; a kvq cache attends over dequantized "
                             f"blocks, one at a time)")
            else:
                lines.append(f"  {op:<10} -> (no implementation installed)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready form of the plan (``kvq select --json``)."""
        return {
            "method": self.method, "params": repr(self.params), "shape": list(self.shape),
            "dtype": str(self.dtype), "device": self.device, "notes": list(self.notes),
            "not_ready": None if self.not_ready is None else str(self.not_ready),
            "ops": {op: None if c is None else {
                "backend": c.backend, "reason": c.reason,
                "candidates": [attrs.asdict(k) for k in c.candidates]} for op, c in self.choices.items()},
        }


def _bits_line(params: Any, head_dim: int) -> str:
    """What one token costs, as stored (docs/DESIGN.md, "Vocabulary": bits per coordinate): the per-token fields
    show any padding the method pays for (TurboQuant's rotation at a padded head_dim, say)."""
    try:
        accounting = params.accounting(head_dim)
    except ValueError as error:  # e.g. VecInfer without its calibration: explain must still print the plan
        return f"  stores     (bits per coordinate unknown: {error})"
    fields = ", ".join(f"{name} {bits:g}" for name, bits in accounting.per_token.items())
    return (f"  stores     {accounting.bits_per_coordinate:.4g} bits per coordinate at head_dim {head_dim} "
            f"({fields} bits per token and head)")


def shape_bucket(shape: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """``(B, H, T, D)`` with ``T`` rounded up to a power of two (at least 16): selection granularity."""
    B, H, T, D = shape
    return (B, H, max(16, 1 << max(T - 1, 0).bit_length()), D)


def _rank(problem: Problem, implementations: list[Any], kernels: str = "auto",
          table: "tuning.Table | None" = None) -> Choice | None:
    if kernels == "off":
        implementations = [i for i in implementations if not is_kernel(i)]
    elif kernels == "require":
        implementations = [i for i in implementations if is_kernel(i)]
    candidates = []
    for impl in implementations:
        note = impl.explain(problem) if callable(getattr(impl, "explain", None)) else ""  # kvq.contract.Explains
        if impl.supports(problem):
            candidates.append(Candidate(impl.backend, True, float(impl.cost(problem)), note))
        else:
            candidates.append(Candidate(impl.backend, False, None, note or "does not support this problem"))
    # a measured crossover (kvq autotune) decides between a kernel and pure MLX instead of the cost model
    ruled_out, measured = tuning.verdict(table, problem, implementations, candidates)
    usable = [(c.cost, i, c) for i, c in enumerate(candidates) if c.supported and i not in ruled_out]
    if not usable:
        return None
    _, best, chosen = min(usable)
    others = "; ".join(
        f"{c.backend}: " + (f"{c.cost * 1e3:.4g} ms" if c.supported else c.note)
        for i, c in enumerate(candidates) if i != best)
    reason = f"est. {chosen.cost * 1e3:.4g} ms" + (f" ({chosen.note})" if chosen.note else "")
    basis = "; ".join(measured) if measured else f"lowest cost of {len(usable)} supporting this shape"
    reason += f"; {basis}" + (f" [{others}]" if others else "")
    return Choice(problem.op, implementations[best], tuple(candidates), reason)


def _missing(reg, method, op, shape, dtype, kind, kernels) -> str:
    """The error message when no allowed implementation serves ``op``."""
    if kernels != "require":
        what = "pure-MLX implementation" if kernels == "off" else "installed implementation"
        return f"no {what} of {method!r} supports op {op!r} for shape {shape} {dtype} on {kind}"
    installed = sorted({i.backend for o in OPS for i in reg.implementations_of(method, o) if is_kernel(i)})
    have = (f"installed kernel back ends for {method!r}: {', '.join(installed)}" if installed
            else f"no kernel implementation of {method!r} is installed ({install_command('kvq-metal')})")
    return (f"kernels='require': no kernel serves {method!r} op {op!r} for shape {shape} {dtype} on this "
            f"{kind} device ({have}; kernels run on Apple GPUs through Metal and on NVIDIA GPUs through "
            f"CUDA). Use kernels='auto' (--kernels auto) to fall back to pure MLX.")


def _for_head_dim(params: Any, head_dim: int) -> tuple[Any, tuple[str, ...]]:
    """``params`` with head_dim-dependent defaults made concrete (:class:`kvq.contract.ForHeadDim`), and a note per
    field that changed (``"group_size: 32 for head_dim 32 (given as None: the method's default for the
    head_dim)"``)."""
    for_head_dim = optional_hook(params, ForHeadDim)
    if for_head_dim is None:
        return params, ()
    resolved = for_head_dim(head_dim)
    fields = [f.name for f in attrs.fields(type(params))] if attrs.has(type(params)) else []
    return resolved, tuple(f"{name}: {getattr(resolved, name)!r} for head_dim {head_dim} (given as "
                           f"{getattr(params, name)!r}: the method's default for the head_dim)"
                           for name in fields if getattr(params, name) != getattr(resolved, name))


def _not_ready(params: Any) -> Exception | None:
    """What ``params.check_ready()`` raises (:class:`kvq.contract.ChecksReady`), or ``None``."""
    check_ready = optional_hook(params, ChecksReady)
    try:
        if check_ready is not None:
            check_ready()
    except ValueError as error:
        return error
    return None


def select(
    method: str,
    shape: tuple[int, int, int, int],
    *,
    dtype: Any = mx.float16,
    device: Any = None,
    op: str | None = None,
    params: Any = None,
    num_queries: int = 1,
    num_q_heads: int | None = None,
    kernels: str = "auto",
) -> Plan:
    """Choose, per op, the cheapest implementation that supports ``method`` on ``shape``.

    :param method: installed method name.
    :param shape: ``(B, H_kv, T, D)`` of keys/values (``T`` = context length for ``attend``).
    :param dtype: dtype of the uncompressed data (float16, bfloat16, float32).
    :param device: ``mx.Device``, ``"cpu"``, ``"gpu"``, ``"metal"``, ``"cuda"`` or ``None`` (MLX's default).
    :param op: one op name, or ``None`` for all four.
    :param params: the method's parameter object; ``None`` uses its defaults.
    :param num_queries: ``T_q`` for ``attend`` (1 in decode). :param num_q_heads: ``H_q`` (GQA).
    :param kernels: ``"auto"`` (default: kernels and pure MLX ranked by cost, or by this device's measured
        crossover where ``kvq autotune`` stored one: :mod:`kvq.tuning`), ``"require"`` (kernel
        implementations only) or ``"off"`` (pure MLX only); see :data:`KERNELS`.
    :return: :class:`Plan` with ``params`` made concrete for ``shape`` (:class:`kvq.contract.ForHeadDim`); ops
        without a supporting implementation are absent from ``plan.choices``. Parameters that cannot encode yet
        (:class:`kvq.contract.ChecksReady`, e.g. VecInfer without a calibration) give a plan that says why
        (``plan.not_ready``, :meth:`Plan.explain`) and whose ``quantize`` raises it; such plans are not cached, so
        a calibration made later is seen.
    :raises ValueError: unknown method or op, bad shape, a head_dim the method does not support,
        ``num_q_heads`` not a positive multiple of ``H_kv``, ``kernels`` not one of :data:`KERNELS`, ``op`` given and no allowed implementation supports it, or
        ``kernels="require"`` and no kernel serves any of the ops asked (the message names what is missing).
    :raises TypeError: non-float ``dtype``.
    """
    reg = registry()
    shape = tuple(shape)
    # the decode hot path asks the same question every step: answer from the exact arguments before validating
    # (a key enters this cache only after its arguments passed the checks below)
    kind = device_kind(device)
    fast_key = (method, params, op, shape, dtype, kind, num_queries, num_q_heads, kernels, reg.generation,
                tuning.state())
    try:
        plan = _FAST.get(fast_key)
    except TypeError:  # unhashable arguments: the full path says what is wrong
        plan = fast_key = None
    if plan is not None:
        return plan
    if len(_FAST) > 8192:
        _FAST.clear()
    declaration = reg.method(method)
    if op is not None and op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}; got {op!r}")
    if dtype not in (mx.float16, mx.bfloat16, mx.float32):
        got = f"the string {dtype!r}" if isinstance(dtype, str) else str(dtype)
        raise TypeError(f"dtype must be mx.float16, mx.bfloat16 or mx.float32 (an mlx.core.Dtype); got {got}")
    params = declaration.make_params() if params is None else params
    if not isinstance(params, declaration.params_class):
        name = declaration.params_class.__name__
        raise TypeError(f"params must be {'an' if name[0] in 'AEIOU' else 'a'} {name} for method {method!r}; got "
                        f"{params!r}")
    Problem(method, "quantize", shape)  # validates the shape
    if num_q_heads is not None and (not isinstance(num_q_heads, int) or num_q_heads < 1
                                    or shape[1] and num_q_heads % shape[1]):
        raise ValueError(f"num_q_heads must be a positive multiple of the shape's H_kv ({shape[1]}: grouped-query "
                         f"attention); got {num_q_heads!r}")
    params.check_head_dim(shape[3])
    check_kernels(kernels)
    ops = OPS if op is None else (op,)
    key = (method, params, ops, shape_bucket(shape), dtype, kind, num_queries, num_q_heads, kernels,
           reg.generation, tuning.state())
    if key in _CACHE:
        if fast_key is not None:
            _FAST[fast_key] = _CACHE[key]
        return _CACHE[key]
    params, notes = _for_head_dim(params, shape[3])  # the key keeps the parameters as given
    not_ready = _not_ready(params)
    choices = {}
    table = tuning.current(kind) if kernels == "auto" else None
    for name in ops:
        problem = Problem(method, name, shape, dtype, kind, params, num_queries, num_q_heads)
        choice = _rank(problem, reg.implementations_of(method, name), kernels, table)
        if choice is not None:
            choices[name] = choice
        elif op is not None:
            raise ValueError(_missing(reg, method, op, shape, dtype, kind, kernels))
    if kernels == "require" and not choices:
        raise ValueError(_missing(reg, method, "/".join(ops), shape, dtype, kind, kernels))
    plan = Plan(method, params, shape, dtype, kind, choices, not_ready, notes)
    if not_ready is None:  # an unready plan is asked again: a calibration made meanwhile is then seen
        _CACHE[key] = plan
        if fast_key is not None:
            _FAST[fast_key] = plan
    return plan
