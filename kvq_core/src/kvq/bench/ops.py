"""``kvq bench ops``: every registered implementation of each op, timed on this device over a range of sizes.

Each implementation that supports the problem here is called directly through its registry object (never
through :func:`kvq.select`), so kernels and pure MLX are both measured; each row also says which of them
``kvq.select`` picks for that problem. Shapes (float16 unless asked otherwise, head_dim ``D`` = 128):

* ``quantize`` / ``dequantize`` over ``N`` vectors: ``[1, H, N / H, D]`` with ``H = 8`` when 8 divides ``N``
  (else 1). Dequantize decodes what the pure-MLX implementation encoded.
* ``attend``: decode over a context of ``T`` tokens (issue #8): ``B = 1``, ``H_q = 32``, ``H_kv = 8``, one query;
  keys and values encoded by the pure-MLX implementation. ``mx.fast.scaled_dot_product_attention`` on fp16 keys
  and values of the same shape is measured alongside as the reference line.

Per call: ``warmup`` untimed calls, then the median of ``reps`` timed ones (:func:`kvq.bench.measure.time_call`),
and the peak-memory delta of one more call (:func:`kvq.bench.measure.peak_delta`).
"""

from __future__ import annotations

import sys
from typing import Any

import attrs
import mlx.core as mx

from ..evaluation.spec import KVQ_FP16, MLX_AFFINE, parse_method, split_methods
from ..plugins import registry
from ..problem import Problem, device_kind
from ..selection import select
from .measure import nbytes, peak_delta, time_call

#: Ops ``kvq bench ops`` measures (``pack`` is generic bit packing, not a method's op).
OPS = ("quantize", "dequantize", "attend")
DEFAULT_METHODS = ("affine:4", "turboquant:4", "turboquant:3")
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
#: Decode-attention shape of issue #8 (B, H_q, H_kv); one query token.
ATTEND_BATCH, ATTEND_Q_HEADS, ATTEND_KV_HEADS = 1, 32, 8
CODEC_HEADS = 8
#: The implementation name of the fp16 reference line in attend rows.
SDPA = "mx.fast.sdpa"
#: The reference attention row's method label per dtype (uncompressed keys and values of that dtype).
REFERENCE_LABELS = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_SUFFIX = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@attrs.frozen
class BenchMethod:
    """One ``--methods`` entry: its label as written (``turboquant:3``), method name and validated params."""

    label: str
    name: str
    params: Any


@attrs.frozen
class Settings:
    """What to measure. :param sizes: ``N`` (vectors) for quantize/dequantize. :param contexts: ``T`` (tokens)
    for attend. :param warmup: untimed calls per measurement. :param reps: timed calls (the median is kept)."""

    methods: tuple[BenchMethod, ...]
    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    head_dim: int = 128
    dtype: Any = mx.float16
    warmup: int = 3
    reps: int = 10


def parse_methods(text: str | None, head_dim: int = 128) -> tuple[BenchMethod, ...]:
    """``--methods`` in ``kvq eval``'s ``NAME[:BITS][[K=V,...]]`` grammar (one method for keys and values).

    ``None`` gives :data:`DEFAULT_METHODS` that are installed.
    :raises ValueError: bad syntax, a ``+`` pair, ``kNvM`` bits, ``mlx-affine``, sinks/window options, an
        unknown method (the installed ones are named), bad parameters, a head_dim the method rejects, duplicates.
    """
    installed = registry().methods
    if text is None:
        text = ",".join(m for m in DEFAULT_METHODS if m.split(":")[0] in installed)
    methods = []
    for part in split_methods(text):
        # ops are kvq methods': fp16 is kvq's 16-bit method here (mlx-lm's KVCache has none; SDPA is the reference)
        spec = parse_method(KVQ_FP16 if part.strip() == "fp16" else part)
        if (spec.key_method != spec.value_method or spec.key_params != spec.value_params or spec.cache_options
                or spec.is_mlx):
            raise ValueError(f"--methods: {part!r}: kvq bench ops measures one method's ops; write NAME[:BITS]"
                             f"[[NAME=VALUE,...]] (no '+', kNvM bits, sinks/window or {MLX_AFFINE})")
        if spec.key_method not in installed:
            raise ValueError(f"--methods: unknown method {spec.key_method!r} in {part!r}; installed: "
                             f"{', '.join(sorted(installed))}")
        try:
            params = installed[spec.key_method].make_params(**spec.key_params)
            params.check_head_dim(head_dim)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--methods: {part!r}: {exc}") from None
        methods.append(BenchMethod(part, spec.key_method, params))
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--methods: a method is given more than once in {text!r}")
    return tuple(methods)


def parse_ops(text: str | None) -> tuple[str, ...]:
    """``"quantize,attend"`` -> ``("quantize", "attend")``; ``None`` gives all of :data:`OPS`.
    :raises ValueError: an op outside :data:`OPS` (named with the allowed ones), or none."""
    if text is None:
        return OPS
    ops = tuple(o.strip() for o in text.split(",") if o.strip())
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise ValueError(f"--ops must be a comma-separated subset of {', '.join(OPS)}; got {text!r}")
    return tuple(dict.fromkeys(ops))


def parse_sizes(text: str, name: str = "--sizes", example: str = "1K,64K,1M") -> tuple[int, ...]:
    """``"256,4K,1M"`` -> ``(256, 4096, 1048576)`` (K, M, G, T are powers of 1024), sorted, unique.
    :raises ValueError: not positive integers (``name`` is the option named in the message, with ``example``)."""
    values = []
    for item in (t.strip().upper() for t in text.split(",") if t.strip()):
        scale = _SUFFIX.get(item[-1:], 1)
        digits = item[:-1] if scale > 1 else item
        if not digits.isdigit() or int(digits) < 1:
            raise ValueError(f"{name} must be positive integers separated by commas (K, M, G, T suffixes allowed, "
                             f"e.g. {example}); got {text!r}")
        values.append(int(digits) * scale)
    if not values:
        raise ValueError(f"{name} must list at least one size; got {text!r}")
    return tuple(sorted(set(values)))


def parse_size(text: str, option: str, unit: str) -> int:
    """One size, ``"24G"`` -> ``25769803776`` (K, M, G, T are powers of 1024; for ``unit="bytes"`` also ``24GB`` and
    ``24GiB``), as one option takes it (``--budget``, ``--context``).

    :raises ValueError: not one positive size (a list, a fraction, text); the message names ``option`` and ``unit``.
    """
    item = text.strip().upper()
    if unit == "bytes":  # 24GB and 24GiB as 24G
        for suffix in ("IB", "B"):
            head = item[: -len(suffix)]
            if item.endswith(suffix) and len(head) > 1 and head[-1] in "KMGT":
                item = head
                break
    if "," in item or not item:
        raise ValueError(f"{option} takes one size in {unit}, with an optional K, M, G or T suffix (powers of "
                         f"1024: 24G, 141G{'; 24GB and 24GiB mean 24G' if unit == 'bytes' else ''}); "
                         f"got {text!r}")
    try:
        (size,) = parse_sizes(item, option)
    except ValueError:
        raise ValueError(f"{option} takes one positive size in {unit}, with an optional K, M, G or T suffix "
                         f"(powers of 1024: {'24G, 141G' if unit == 'bytes' else '8K, 32K'}); got {text!r}") \
            from None
    return size


def default_sizes(kind: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(sizes, contexts)`` for a device kind: 1K..4M vectors and 1K..128K tokens on a GPU; small on the CPU."""
    if kind == "cpu":
        return (1024, 4096, 16384), (1024, 4096)
    return tuple(4**i * 1024 for i in range(7)), (1024, 4096, 16384, 65536, 131072)


def codec_shape(n: int, head_dim: int) -> tuple[int, int, int, int]:
    """``[1, H, N / H, D]`` for ``N`` vectors (``H`` = 8 when 8 divides ``N``, else 1)."""
    heads = CODEC_HEADS if n % CODEC_HEADS == 0 else 1
    return (1, heads, n // heads, head_dim)


def attend_shape(context: int, head_dim: int) -> tuple[int, int, int, int]:
    """Keys/values ``[1, 8, T, D]`` of the decode-attention benchmark."""
    return (ATTEND_BATCH, ATTEND_KV_HEADS, context, head_dim)


def problem_for(method: BenchMethod, op: str, size: int, settings: Settings, kind: str) -> Problem:
    """The selection problem of one measurement (``size`` = ``N`` vectors, or ``T`` tokens for attend)."""
    if op == "attend":
        return Problem(method.name, op, attend_shape(size, settings.head_dim), settings.dtype, kind,
                       method.params, 1, ATTEND_Q_HEADS)
    return Problem(method.name, op, codec_shape(size, settings.head_dim), settings.dtype, kind, method.params)


def _encoder(name: str):
    """The pure-MLX implementation of a method (it encodes the inputs of dequantize and attend)."""
    impls = registry().implementations
    return impls.get((name, "mlx")) or registry().implementations_of(name, "quantize")[0]


def _selected(problem: Problem) -> str | None:
    try:
        plan = select(problem.method, problem.shape, dtype=problem.dtype, device=problem.device, op=problem.op,
                      params=problem.params, num_q_heads=problem.num_q_heads)
    except ValueError:
        return None
    return plan.choices[problem.op].backend


def _call(impl, op: str, method: BenchMethod, inputs: dict, settings: Settings):
    """A zero-argument callable running ``op`` of ``impl`` on ``inputs``."""
    if op == "quantize":
        return lambda: impl.kvq_quantize(inputs["x"], method.params)
    if op == "dequantize":
        return lambda: impl.kvq_dequantize(inputs["encoded"], settings.dtype)
    scale = settings.head_dim**-0.5
    return lambda: impl.kvq_attend(inputs["q"], inputs["keys"], inputs["values"], scale, None)


def _inputs(op: str, method: BenchMethod, base: dict) -> dict:
    """Inputs of one method's op from the random fp16 data ``base``, evaluated."""
    if op == "quantize":
        out = {"x": base["x"]}
    elif op == "dequantize":
        out = {"encoded": _encoder(method.name).kvq_quantize(base["x"], method.params)}
    else:
        encode = _encoder(method.name).kvq_quantize
        out = {"q": base["q"], "keys": encode(base["k"], method.params), "values": encode(base["v"], method.params)}
    mx.eval([a for v in out.values() for a in (v.data.values() if hasattr(v, "data") else [v])])
    return out


def _base(op: str, size: int, settings: Settings) -> dict:
    if op != "attend":
        x = mx.random.normal(codec_shape(size, settings.head_dim)).astype(settings.dtype)
        mx.eval(x)
        return {"x": x}
    kv = attend_shape(size, settings.head_dim)
    q = mx.random.normal((ATTEND_BATCH, ATTEND_Q_HEADS, 1, settings.head_dim)).astype(settings.dtype)
    k, v = (mx.random.normal(kv).astype(settings.dtype) for _ in range(2))
    mx.eval(q, k, v)
    return {"q": q, "k": k, "v": v}


def _measure(fn, settings: Settings) -> dict:
    row = time_call(fn, settings.warmup, settings.reps)
    row.update(peak_delta(fn))
    return row


def _row(method_label: str, name: str, params: Any, op: str, impl: str, size: int, shape, settings) -> dict:
    return {"method": method_label, "method_name": name, "params": repr(params), "op": op, "implementation": impl,
            "size": size, "size_unit": "tokens" if op == "attend" else "vectors", "shape": list(shape),
            "dtype": str(settings.dtype).removeprefix("mlx.core.")}


def _sdpa_row(base: dict, size: int, settings: Settings) -> dict:
    q, k, v = base["q"], base["k"], base["v"]
    scale = settings.head_dim**-0.5
    label = REFERENCE_LABELS[str(settings.dtype).removeprefix("mlx.core.")]
    row = _row(label, label, None, "attend", SDPA, size, k.shape, settings)
    row.update(_measure(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale), settings))
    row.update(input_bytes=q.nbytes + k.nbytes + v.nbytes, kv_bytes=k.nbytes + v.nbytes, selected=None)
    return row


def _method_rows(method: BenchMethod, op: str, size: int, base: dict, settings: Settings, kind: str,
                 skipped: list) -> list[dict]:
    problem = problem_for(method, op, size, settings, kind)
    impls = [i for i in registry().implementations_of(method.name, op) if i.method == method.name]
    where = f"{method.label} {op} size {size}"
    if not impls:
        skipped.append({"method": method.label, "op": op, "size": size, "implementation": None,
                        "reason": f"no implementation of {method.name!r} serves {op}"})
        return []
    inputs, chosen, rows = _inputs(op, method, base), _selected(problem), []
    for impl in impls:
        if not impl.supports(problem):
            note = impl.explain(problem) if callable(getattr(impl, "explain", None)) else ""  # contract.Explains
            skipped.append({"method": method.label, "op": op, "size": size, "implementation": impl.backend,
                            "reason": note or f"does not support {where} on {kind}"})
            continue
        row = _row(method.label, method.name, method.params, op, impl.backend, size, problem.shape, settings)
        row.update(_measure(_call(impl, op, method, inputs, settings), settings))
        row.update(input_bytes=sum(nbytes(v) for v in inputs.values()), selected=impl.backend == chosen)
        if op == "attend":
            row["kv_bytes"] = inputs["keys"].nbytes + inputs["values"].nbytes
        rows.append(row)
    return rows


def _progress(total: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a convenience; the GPU host may lack tqdm
        return None
    return tqdm(total=total, desc="kvq bench ops", unit="step", file=sys.stderr, disable=not enabled)


def run(settings: Settings, progress: bool = False, on_step: Any = None) -> dict:
    """Measure every (method, op, size, implementation) of ``settings`` on MLX's default device.

    :return: ``{"rows": [...], "skipped": [...]}``. A row: ``method`` (label), ``method_name``, ``params``,
        ``op``, ``implementation`` (backend, or ``mx.fast.sdpa`` for the uncompressed reference, whose ``method`` is
        :data:`REFERENCE_LABELS`' name of the dtype), ``size`` and
        ``size_unit`` (``vectors`` or ``tokens``), ``shape``, ``dtype``, ``median_s``/``min_s`` (seconds),
        ``reps``, ``peak_delta_bytes``/``output_bytes``/``intermediate_bytes``, ``input_bytes``, ``selected``
        (whether ``kvq.select`` picks this implementation here) and, for attend, ``kv_bytes`` (bytes of K and V
        read: compressed, or fp16 for the reference). ``skipped`` names implementations that do not serve a
        problem here, and why. ``on_step(result)``, when given, is called with the result so far after each
        (op, size) step (``kvq bench ops`` writes its JSON then, so a run cut short keeps what it measured).
    """
    kind = device_kind()
    mx.random.seed(0)
    steps = [(op, size) for op in settings.ops for size in (settings.contexts if op == "attend" else settings.sizes)]
    bar = _progress(len(steps) * len(settings.methods), progress)
    rows, skipped = [], []
    for op, size in steps:
        base = _base(op, size, settings)
        if op == "attend":
            rows.append(_sdpa_row(base, size, settings))
        for method in settings.methods:
            if bar is not None:
                bar.set_postfix_str(f"{method.label} {op} {size}")
            rows.extend(_method_rows(method, op, size, base, settings, kind, skipped))
            if bar is not None:
                bar.update()
        del base
        mx.clear_cache()
        if on_step is not None:
            on_step({"rows": rows, "skipped": skipped})
    if bar is not None:
        bar.close()
    return {"rows": rows, "skipped": skipped}


def add_bandwidth(rows: list[dict], elementwise_Bps: float | None) -> None:
    """Give every attend row ``bandwidth_Bps`` (``kv_bytes / median_s``) and, with the device's measured
    elementwise bandwidth, ``bandwidth_fraction`` (the share of it achieved). Modifies ``rows`` in place."""
    for row in rows:
        if row["op"] == "attend" and row.get("kv_bytes"):
            row["bandwidth_Bps"] = row["kv_bytes"] / row["median_s"]
            if elementwise_Bps:
                row["bandwidth_fraction"] = row["bandwidth_Bps"] / elementwise_Bps
