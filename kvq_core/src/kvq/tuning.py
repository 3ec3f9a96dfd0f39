"""Stored crossovers between pure MLX and each kernel (written by ``kvq autotune``), and their use in selection.

This is the lookup half of autotuning: :func:`kvq.select` reads tables here, and nothing here imports the
benchmark tooling. The measuring half, :mod:`kvq.bench.autotune` (``kvq autotune``), times pure MLX against each
kernel over a grid of sizes and finds each kernel's crossover: the smallest measured size from which the kernel
is faster at every larger measured size (``0`` when it is faster at all of them, :data:`NEVER` when it is slower
at the largest). :func:`save` stores the table as JSON under ``$KVQ_CACHE_DIR/autotune`` (else
``platformdirs.user_cache_dir("kvq")/autotune``), one file per device kind, device name, MLX version and kvq
version (:func:`table_path`).

Sizes (:func:`problem_size`): vectors ``B * H * T`` for quantize/dequantize; context tokens ``B * T`` for attend
(the grid runs ``B = 1``, ``H_q = 32``, ``H_kv = 8``, ``D = 128``, float16). A crossover is applied to every
head_dim, dtype and GQA ratio; selection's shape buckets (``T`` rounded up to a power of two) apply too.

In :func:`kvq.select` (``kernels="auto"``), when this device has a table with an entry for the (method, op,
kernel backend) being ranked, the crossover decides between that kernel and pure MLX (kernel iff
``size >= crossover``) instead of the cost model. An entry measured with the same parameters is used; else the
largest crossover measured for that method/op/backend with other parameters. A table that cannot be read
is ignored with an :class:`AutotuneWarning` naming the file; selection then uses the cost model.
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import attrs

from .contract import ForHeadDim, optional_hook
from .paths import cache_root
from .problem import device_kind, device_name

FORMAT = "kvq-autotune/1"
#: Crossover of a kernel that was slower than pure MLX at the largest measured size.
NEVER = sys.maxsize
_GENERATION = 0
_LOADED: dict[tuple, "Table | None"] = {}


class AutotuneWarning(UserWarning):
    """An autotune table that cannot be used (unreadable, malformed, or from another device or version)."""


@attrs.frozen
class Entry:
    """The measured crossover of one kernel against pure MLX for one method/op.

    :param method: method name. :param label: the ``--methods`` string measured (``turboquant:3``).
    :param params: the method's parameters as a JSON dict. :param op: ``quantize``, ``dequantize``, ``attend``.
    :param backend: the kernel's backend (``cuda``, ``metal``, ...).
    :param crossover: size from which the kernel is faster (0: always; :data:`NEVER`: never).
    :param sizes: measured sizes (ascending); ``kernel_s``, ``mlx_s``: median seconds at each.
    """

    method: str
    label: str
    params: dict
    op: str
    backend: str
    crossover: int
    sizes: tuple[int, ...] = ()
    kernel_s: tuple[float, ...] = ()
    mlx_s: tuple[float, ...] = ()

    def to_json(self) -> dict:
        """The stored form: ``crossover`` as an int or ``"never"``, plus a readable ``verdict``."""
        data = attrs.asdict(self)
        data.update(crossover="never" if self.crossover == NEVER else self.crossover,
                    verdict=verdict_text(self.crossover))
        return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}

    @classmethod
    def from_json(cls, data: Any) -> "Entry":
        """An entry from its stored form. :raises ValueError: a missing or ill-typed field (named)."""
        if not isinstance(data, dict):
            raise ValueError(f"an entry must be an object; got {type(data).__name__}")
        for name in ("method", "label", "op", "backend"):
            if not isinstance(data.get(name), str):
                raise ValueError(f"entry field {name!r} must be a string; got {data.get(name)!r}")
        cross = data.get("crossover")
        if cross == "never":
            cross = NEVER
        if not isinstance(cross, int) or isinstance(cross, bool) or cross < 0:
            raise ValueError(f"entry crossover must be an int >= 0 or 'never'; got {data.get('crossover')!r}")
        if not isinstance(data.get("params"), dict):
            raise ValueError(f"entry params must be an object; got {data.get('params')!r}")
        series = {k: tuple(data.get(k, ())) for k in ("sizes", "kernel_s", "mlx_s")}
        return cls(data["method"], data["label"], data["params"], data["op"], data["backend"], cross, **series)


@attrs.frozen
class Table:
    """One device's autotune table: where it was read from and its entries."""

    path: Path
    device: str
    entries: tuple[Entry, ...]

    def lookup(self, method: str, op: str, backend: str, params: Any = None,
               head_dim: int | None = None) -> tuple[Entry, bool] | None:
        """The entry for ``(method, op, backend)`` and whether its params equal ``params`` (a params object or
        JSON dict); without an exact match, the entry with the largest crossover. ``None``: nothing measured.

        :param head_dim: compare parameters as they are at this head_dim, where the params class resolves
            defaults per head_dim (:class:`kvq.contract.ForHeadDim`: affine's ``group_size=None`` is 64 at
            head_dim 128, so a table written with either form matches a problem with the other)."""
        found = [e for e in self.entries if (e.method, e.op, e.backend) == (method, op, backend)]
        if not found:
            return None
        wanted = _resolved_json(params, params, head_dim) if params is not None else None
        exact = [e for e in found if _resolved_json(e.params, params, head_dim) == wanted]
        return (exact[0], True) if exact else (max(found, key=lambda e: e.crossover), False)


def verdict_text(crossover: int) -> str:
    """``"always"``, ``"never"`` or ``"from N"``."""
    return "always" if crossover == 0 else "never" if crossover == NEVER else f"from {crossover}"


def _resolved_json(value: Any, like: Any, head_dim: int | None) -> dict:
    """``value`` (a params object, or a JSON dict of the class of the object ``like``) as JSON, with its
    ``for_head_dim(head_dim)`` applied where the class has one (:class:`kvq.contract.ForHeadDim`, read with
    :func:`kvq.contract.optional_hook`); unresolvable values are compared as written."""
    if head_dim is None or isinstance(like, dict) or optional_hook(like, ForHeadDim) is None:
        return params_json(value)
    try:
        obj = type(like)(**value) if isinstance(value, dict) else value
        return params_json(optional_hook(obj, ForHeadDim)(head_dim))
    except (TypeError, ValueError):
        return params_json(value)


def params_json(params: Any) -> dict:
    """A parameter object (or dict) as the JSON dict stored in tables."""
    data = params if isinstance(params, dict) else attrs.asdict(params)
    return json.loads(json.dumps(data))


def problem_size(problem) -> int:
    """The size a crossover is compared with: ``B * T`` context tokens for attend, else ``B * H * T`` vectors."""
    B, H, T, _ = problem.shape
    return B * T if problem.op == "attend" else B * H * T


def cache_dir() -> Path:
    """``$KVQ_CACHE_DIR/autotune``, else ``platformdirs.user_cache_dir("kvq")/autotune`` (not created here)."""
    return cache_root() / "autotune"


def identity(device: Any = None) -> dict:
    """What a table is keyed by: device kind and name, MLX version, kvq version."""
    import mlx.core as mx

    from . import __version__

    return {"device_kind": device_kind(device), "device": device_name(device), "mlx": mx.__version__,
            "kvq": __version__}


def table_path(device: Any = None) -> Path:
    """The table file of a device (``None``: MLX's default): ``<kind>_<device>_mlx-<v>_kvq-<v>.json``."""
    ident = identity(device)
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", ident["device"]).strip("-") or "unknown"
    return cache_dir() / f"{ident['device_kind']}_{slug}_mlx-{ident['mlx']}_kvq-{ident['kvq']}.json"


# -- storing and loading ----------------------------------------------------------------------------------
def save(document: dict, path: str | Path | None = None) -> Path:
    """Write a table document (from :func:`kvq.bench.autotune.measure`) to ``path`` (default: :func:`table_path`
    of this device), atomically; selection in this process sees it at once. :return: the path written."""
    path = Path(path) if path is not None else table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    os.replace(tmp, path)
    reset()
    return path


def _parse(path: Path, expected: dict) -> Table:
    """:raises ValueError: unreadable JSON, wrong format, another device/version, or a malformed entry."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"its 'format' is not {FORMAT!r}")
    for key, want in expected.items():
        if data.get(key) != want:
            raise ValueError(f"it was measured with {key} {data.get(key)!r}, this is {want!r}")
    if not isinstance(data.get("entries"), list):
        raise ValueError("its 'entries' is not a list")
    return Table(path, expected["device"], tuple(Entry.from_json(e) for e in data["entries"]))


def load(device: Any = None) -> Table | None:
    """The autotune table of ``device`` (``None``: MLX's default), or ``None`` when there is none. A file that
    cannot be used is ignored with an :class:`AutotuneWarning` naming it and saying why (never an error)."""
    path = table_path(device)
    if not path.is_file():
        return None
    try:
        return _parse(path, identity(device))
    except ValueError as exc:
        warnings.warn(f"kvq autotune table {path} is ignored: {exc}; selection uses the cost model "
                      f"(run 'kvq autotune' to measure again)", AutotuneWarning, stacklevel=2)
        return None


def state() -> tuple:
    """What selection caches key on: the cache root and a counter bumped by :func:`save` and :func:`reset`."""
    return os.environ.get("KVQ_CACHE_DIR"), _GENERATION


def reset() -> None:
    """Forget loaded tables: the next selection reads the files again."""
    global _GENERATION
    _GENERATION += 1
    _LOADED.clear()


def current(kind: str) -> Table | None:
    """:func:`load` for a device kind, read once per :func:`state` (a bad file warns once)."""
    key = (kind, *state())
    if key not in _LOADED:
        _LOADED[key] = load(kind)
    return _LOADED[key]


# -- selection --------------------------------------------------------------------------------------------
def crossover(method: str, op: str, backend: str, problem) -> int | None:
    """The measured size from which ``backend``'s kernel beats pure MLX for ``problem``'s method/op (0: always;
    :data:`NEVER`: never), or ``None`` when this device's table has no entry (or there is no table)."""
    table = current(problem.device)
    found = table.lookup(method, op, backend, problem.params, problem.head_dim) if table is not None else None
    return None if found is None else found[0].crossover


def _note(entry: Entry, exact: bool, size: int, unit: str, wins: bool, path: Path) -> str:
    shown = "never" if entry.crossover == NEVER else entry.crossover
    note = f"measured crossover {shown} (kvq autotune, {path}): "
    if entry.crossover in (0, NEVER):
        note += f"the {entry.backend} kernel was {'faster' if wins else 'slower'} at every measured size"
    else:
        note += f"{unit}={size} {'>=' if wins else '<'} {entry.crossover}, " + (
            f"the {entry.backend} kernel is faster" if wins else "pure MLX is faster")
    return note + ("" if exact else f" (measured with {entry.label}, other parameters)")


def verdict(table: Table | None, problem, implementations: list, candidates: list) -> tuple[set[int], list[str]]:
    """Which supporting candidates the measured crossovers rule out, and why (for :func:`kvq.select`).

    For each supporting kernel with an entry, pure MLX is ruled out when ``size >= crossover``, else the kernel.
    :return: ``(indices ruled out, notes)``; nothing when there is no table, no supporting pure MLX, or no entry.
    """
    mlx = [i for i, impl in enumerate(implementations) if impl.backend == "mlx" and candidates[i].supported]
    if table is None or not mlx:
        return set(), []
    size, unit = problem_size(problem), "B*T" if problem.op == "attend" else "N"
    excluded, notes = set(), []
    for i, impl in enumerate(implementations):
        found = (table.lookup(problem.method, problem.op, impl.backend, problem.params, problem.head_dim)
                 if impl.backend != "mlx" and candidates[i].supported else None)
        if found is not None:
            wins = size >= found[0].crossover
            excluded.add(mlx[0] if wins else i)
            notes.append(_note(*found, size, unit, wins, table.path))
    return excluded, notes
