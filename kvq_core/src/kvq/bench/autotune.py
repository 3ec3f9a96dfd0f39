"""``kvq autotune``'s measuring: crossovers between pure MLX and each kernel, timed on this device.

:func:`measure` times the pure-MLX implementation and every kernel implementation of each method/op over a grid
of sizes (the machinery of ``kvq bench ops``); :func:`from_bench` reads the same rows from a ``kvq bench ops``
result. Each kernel's crossover (:func:`find_crossover`) goes into a table document that :func:`kvq.tuning.save`
stores and :func:`kvq.select` reads (:mod:`kvq.tuning`: the lookup, which imports nothing from here).
"""

from __future__ import annotations

from typing import Sequence

import attrs

from ..plugins import registry
from ..problem import device_kind
from ..tuning import FORMAT, NEVER, Entry, identity, params_json
from . import measure as bench_measure, ops as bench_ops
from .ops import problem_for


def find_crossover(sizes: Sequence[int], kernel_s: Sequence[float], mlx_s: Sequence[float]) -> int:
    """The smallest size from which the kernel is faster at every larger measured size.

    :param sizes: ascending sizes; ``kernel_s``/``mlx_s``: seconds at each (same length).
    :return: that size; 0 when the kernel is faster at every size; :data:`NEVER` when it is not faster at the
        largest. :raises ValueError: empty or unequal-length sequences, or unsorted sizes.
    """
    if not sizes or not (len(sizes) == len(kernel_s) == len(mlx_s)):
        raise ValueError(f"sizes, kernel_s and mlx_s must be non-empty and of one length; got {len(sizes)}, "
                         f"{len(kernel_s)}, {len(mlx_s)}")
    if list(sizes) != sorted(sizes):
        raise ValueError(f"sizes must be ascending; got {list(sizes)}")
    start = len(sizes)
    while start > 0 and kernel_s[start - 1] < mlx_s[start - 1]:
        start -= 1
    return 0 if start == 0 else NEVER if start == len(sizes) else int(sizes[start])


def _entries(rows: list[dict], method) -> list[Entry]:
    """Crossover entries of one method from ``kvq bench ops`` rows (kernels measured against pure MLX)."""
    entries = []
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["method"] == method.label and r["op"] == op]
        mlx = {r["size"]: r["median_s"] for r in mine if r["implementation"] == "mlx"}
        for backend in dict.fromkeys(r["implementation"] for r in mine if r["implementation"] != "mlx"):
            kernel = {r["size"]: r["median_s"] for r in mine if r["implementation"] == backend}
            sizes = sorted(kernel.keys() & mlx.keys())
            if sizes:
                k_s, m_s = [kernel[s] for s in sizes], [mlx[s] for s in sizes]
                entries.append(Entry(method.name, method.label, params_json(method.params), op, backend,
                                     find_crossover(sizes, k_s, m_s), tuple(sizes), tuple(k_s), tuple(m_s)))
    return entries


def _kernel_runs(method, op: str, grid, kind: str) -> bool:
    """Whether some kernel implementation of ``method`` supports ``op`` here at some size of the grid."""
    kernels = [i for i in registry().implementations_of(method.name, op) if i.backend != "mlx"
               and i.method == method.name]
    sizes = grid.contexts if op == "attend" else grid.sizes
    return any(k.supports(problem_for(method, op, s, grid, kind)) for k in kernels for s in sizes)


def measure(methods: str | None = None, ops: str | None = None, sizes: Sequence[int] | None = None,
            contexts: Sequence[int] | None = None, *, warmup: int = 2, reps: int = 5, command: str = "",
            progress: bool = False) -> dict:
    """Time pure MLX against every kernel implementation over a grid of sizes on MLX's default device.

    Only method/op pairs with a registered kernel implementation (backend other than ``mlx``) are measured.

    :param methods: ``kvq bench ops`` method strings (default: its defaults). :param ops: comma-separated ops.
    :param sizes: ``N`` vectors for quantize/dequantize; :param contexts: ``T`` tokens for attend (defaults:
        :func:`kvq.bench.ops.default_sizes` for this device). :param warmup, reps: per measurement.
    :param command: the command line recorded in the table.
    :return: the table document (``format``, identity, ``environment``, ``entries``) for :func:`kvq.tuning.save`.
    :raises ValueError: bad ``methods``/``ops``/``warmup``/``reps`` (before anything is measured).
    """
    chosen, op_names = bench_ops.parse_methods(methods), bench_ops.parse_ops(ops)
    kind = device_kind()
    default_sizes, default_contexts = bench_ops.default_sizes(kind)
    entries, measured = [], []
    for method in chosen:
        grid = bench_ops.Settings((method,), op_names, tuple(sizes or default_sizes),
                                  tuple(contexts or default_contexts), warmup=warmup, reps=reps)
        kernel_ops = tuple(op for op in op_names if _kernel_runs(method, op, grid, kind))
        if not kernel_ops:
            continue
        rows = bench_ops.run(attrs.evolve(grid, ops=kernel_ops), progress=progress)["rows"]
        entries += _entries([r for r in rows if r["implementation"] != bench_ops.SDPA], method)
        measured.append({"method": method.label, "ops": list(kernel_ops)})
    return {"format": FORMAT, **identity(), "environment": bench_measure.environment(command),
            "grid": {"sizes": list(sizes or default_sizes), "contexts": list(contexts or default_contexts),
                     "warmup": warmup, "reps": reps, "measured": measured},
            "entries": [e.to_json() for e in entries]}


def from_bench(document: dict, command: str = "") -> dict:
    """The table document of a ``kvq bench ops`` result measured on this device with this MLX and kvq (its
    rows are the same measurements :func:`measure` makes), so one GPU run gives both.

    :raises ValueError: ``document`` is not a ``kvq bench ops`` result, or was measured on another device or
        with another MLX or kvq version (the message names which).
    """
    if not isinstance(document, dict) or document.get("benchmark") != "kvq bench ops":
        raise ValueError("--from-bench: not a kvq bench ops result (bench_ops.json)")
    env, here = document.get("environment", {}), identity()
    for key, want in here.items():
        if env.get(key) != want:
            raise ValueError(f"--from-bench: measured with {key} {env.get(key)!r}, this is {want!r}")
    settings = document["settings"]
    methods = bench_ops.parse_methods(",".join(settings["methods"]), settings["head_dim"])
    rows = [r for r in document["rows"] if r["implementation"] != bench_ops.SDPA]
    entries = [e for m in methods for e in _entries(rows, m)]
    grid = {k: settings[k] for k in ("sizes", "contexts", "warmup", "reps")}
    return {"format": FORMAT, **here, "environment": {**bench_measure.environment(command), "measured": env},
            "grid": {**grid, "from_bench": env.get("command")}, "entries": [e.to_json() for e in entries]}
