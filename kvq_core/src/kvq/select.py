"""``kvq.select``: per shape, the implementation of each op that supports the problem at the lowest cost.

Selection runs once per (method, params, op, shape bucket, dtype, device) and is cached; the returned
:class:`Plan` holds bound callables, so per-token calls go straight to the chosen implementation.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import mlx.core as mx

from .hookspecs import OPS
from .problem import Problem, device_kind
from .plugins import registry

_CACHE: dict[tuple, "Plan"] = {}


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
        return self.implementation.backend


@attrs.frozen
class Plan:
    """What :func:`select` chose for each op of one method on one shape.

    The hot path uses the bound callables: ``plan.quantize(x, params)``, ``plan.dequantize(enc, dtype)``,
    ``plan.attend(q, k_enc, v_enc, scale, mask)``, ``plan.pack(codes, bits)``, ``plan.unpack(packed, bits,
    count)``; each is ``None`` when no installed implementation serves that op.
    """

    method: str
    params: Any
    shape: tuple[int, int, int, int]
    dtype: Any
    device: str
    choices: dict[str, Choice]

    def _bound(self, op: str, hook: str) -> Callable | None:
        choice = self.choices.get(op)
        return None if choice is None else getattr(choice.implementation, hook)

    @property
    def quantize(self):
        return self._bound("quantize", "kvq_quantize")

    @property
    def dequantize(self):
        return self._bound("dequantize", "kvq_dequantize")

    @property
    def attend(self):
        return self._bound("attend", "kvq_attend")

    @property
    def pack(self):
        return self._bound("pack", "kvq_pack")

    @property
    def unpack(self):
        return self._bound("pack", "kvq_unpack")

    def explain(self) -> str:
        """A human-readable account of the choice per op."""
        lines = [f"{self.method} {self.params} shape={self.shape} dtype={self.dtype} device={self.device}"]
        for op in OPS:
            choice = self.choices.get(op)
            lines.append(f"  {op:<10} -> " + ("(no implementation installed)" if choice is None
                                              else f"{choice.backend}: {choice.reason}"))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready form of the plan (``kvq select --json``)."""
        return {
            "method": self.method, "params": repr(self.params), "shape": list(self.shape),
            "dtype": str(self.dtype), "device": self.device,
            "ops": {op: None if c is None else {
                "backend": c.backend, "reason": c.reason,
                "candidates": [attrs.asdict(k) for k in c.candidates]} for op, c in self.choices.items()},
        }


def shape_bucket(shape: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """``(B, H, T, D)`` with ``T`` rounded up to a power of two (at least 16): selection granularity."""
    B, H, T, D = shape
    return (B, H, max(16, 1 << max(T - 1, 0).bit_length()), D)


def _rank(problem: Problem, implementations: list[Any]) -> Choice | None:
    candidates = []
    for impl in implementations:
        note = impl.explain(problem) if callable(getattr(impl, "explain", None)) else ""
        if impl.supports(problem):
            candidates.append(Candidate(impl.backend, True, float(impl.cost(problem)), note))
        else:
            candidates.append(Candidate(impl.backend, False, None, note or "does not support this problem"))
    usable = [(c.cost, i, c) for i, c in enumerate(candidates) if c.supported]
    if not usable:
        return None
    _, best, chosen = min(usable)
    others = "; ".join(
        f"{c.backend}: " + (f"{c.cost * 1e3:.4g} ms" if c.supported else c.note)
        for i, c in enumerate(candidates) if i != best)
    reason = f"est. {chosen.cost * 1e3:.4g} ms" + (f" ({chosen.note})" if chosen.note else "")
    reason += f"; lowest cost of {len(usable)} supporting" + (f" [{others}]" if others else "")
    return Choice(problem.op, implementations[best], tuple(candidates), reason)


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
) -> Plan:
    """Choose, per op, the cheapest implementation that supports ``method`` on ``shape``.

    :param method: installed method name.
    :param shape: ``(B, H_kv, T, D)`` of keys/values (``T`` = context length for ``attend``).
    :param dtype: dtype of the uncompressed data (float16, bfloat16, float32).
    :param device: ``mx.Device``, ``"cpu"``, ``"gpu"``, ``"metal"``, ``"cuda"`` or ``None`` (MLX's default).
    :param op: one op name, or ``None`` for all four.
    :param params: the method's parameter object; ``None`` uses its defaults.
    :param num_queries: ``T_q`` for ``attend`` (1 in decode). :param num_q_heads: ``H_q`` (GQA).
    :return: :class:`Plan`; ops without a supporting implementation are absent from ``plan.choices``.
    :raises ValueError: unknown method or op, bad shape, a head_dim the method does not support, or ``op``
        given and no installed implementation supports it.
    :raises TypeError: non-float ``dtype``.
    """
    reg = registry()
    declaration = reg.method(method)
    if op is not None and op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}; got {op!r}")
    if dtype not in (mx.float16, mx.bfloat16, mx.float32):
        raise TypeError(f"dtype must be float16, bfloat16 or float32; got {dtype}")
    params = declaration.make_params() if params is None else params
    if not isinstance(params, declaration.params_class):
        raise TypeError(f"params must be a {declaration.params_class.__name__} for method {method!r}; got {params!r}")
    shape = tuple(shape)
    Problem(method, "quantize", shape)  # validates the shape
    params.check_head_dim(shape[3])
    kind = device_kind(device)
    ops = OPS if op is None else (op,)
    key = (method, params, ops, shape_bucket(shape), dtype, kind, num_queries, num_q_heads, reg.generation)
    if key in _CACHE:
        return _CACHE[key]
    choices = {}
    for name in ops:
        problem = Problem(method, name, shape, dtype, kind, params, num_queries, num_q_heads)
        choice = _rank(problem, reg.implementations_of(method, name))
        if choice is not None:
            choices[name] = choice
        elif op is not None:
            raise ValueError(f"no installed implementation of {method!r} supports op {op!r} for shape {shape} "
                             f"{dtype} on {kind}")
    plan = _CACHE[key] = Plan(method, params, shape, dtype, kind, choices)
    return plan
