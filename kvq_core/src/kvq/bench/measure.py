"""Measurement primitives shared by ``kvq bench`` and ``kvq autotune``: wall time of evaluated MLX calls, the
peak-memory delta of one call, the device's elementwise bandwidth, and the environment a result was measured in.

Every call is followed by ``mx.eval`` on all arrays it returned, so a time covers building the graph and
running it to completion (what a caller of the op waits for).
"""

from __future__ import annotations

import datetime
import gc
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from .. import provenance
from ..encoded import Encoded
from ..problem import device_kind, device_name


def release() -> None:
    """Free what the last measurement left: Python garbage, then MLX's buffer cache (so memory deltas start
    clean)."""
    from ..cache.prefill import release_shared_mask

    release_shared_mask()
    gc.collect()
    mx.synchronize()
    mx.clear_cache()


def error_text(exc: BaseException) -> str:
    """A failed row's ``error``: ``"Type: first line of the message"``."""
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message.splitlines()[0] if message else ''}"


def arrays_of(result: Any) -> list[mx.array]:
    """Every ``mx.array`` in an op's result: an array, an :class:`~kvq.Encoded` (its fields), or a tuple/list
    of those (``attend``'s ``(out, lse)``)."""
    if isinstance(result, mx.array):
        return [result]
    if isinstance(result, Encoded):
        return list(result.data.values())
    if isinstance(result, (tuple, list)):
        return [a for item in result for a in arrays_of(item)]
    raise TypeError(f"result must be an mx.array, a kvq.Encoded or a tuple of them; got {type(result).__name__}")


def nbytes(result: Any) -> int:
    """Bytes of every array in ``result`` (see :func:`arrays_of`)."""
    return sum(a.nbytes for a in arrays_of(result))


def time_call(fn: Callable[[], Any], warmup: int = 3, reps: int = 10) -> dict:
    """Time ``fn()`` followed by ``mx.eval`` of its arrays: ``warmup`` untimed calls, then ``reps`` timed ones.

    :return: ``{"median_s", "min_s", "reps"}`` (seconds of wall time per call).
    :raises ValueError: ``warmup < 0`` or ``reps < 1``.
    """
    if warmup < 0 or reps < 1:
        raise ValueError(f"warmup must be >= 0 and reps >= 1; got warmup={warmup}, reps={reps}")
    for _ in range(warmup):
        mx.eval(arrays_of(fn()))
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval(arrays_of(fn()))
        times.append(time.perf_counter() - tic)
    return {"median_s": statistics.median(times), "min_s": min(times), "reps": reps}


def peak_delta(fn: Callable[[], Any]) -> dict:
    """Memory one call of ``fn`` needs beyond what is already resident (its inputs included).

    ``mx.reset_peak_memory()`` before, ``mx.get_peak_memory()`` after the evaluated call, minus
    ``mx.get_active_memory()`` before it.

    :return: ``{"peak_delta_bytes", "output_bytes", "intermediate_bytes"}``; ``intermediate_bytes`` is the
        peak delta less the outputs (the temporaries an op allocates; at least 0).
    """
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    result = fn()
    mx.eval(arrays_of(result))
    delta = mx.get_peak_memory() - before
    out = nbytes(result)
    return {"peak_delta_bytes": int(delta), "output_bytes": int(out), "intermediate_bytes": int(max(delta - out, 0))}


def elementwise_bandwidth(total_bytes: int = 2**30, warmup: int = 3, reps: int = 10) -> dict:
    """Measured elementwise bandwidth of the default device: ``a * 2`` over a float32 array of
    ``total_bytes``, bytes read plus bytes written divided by the median time.

    :return: ``{"array_bytes", "bytes_moved", "median_s", "bandwidth_Bps"}`` (bytes per second).
    :raises ValueError: ``total_bytes < 4``.
    """
    if total_bytes < 4:
        raise ValueError(f"total_bytes must be >= 4; got {total_bytes}")
    a = mx.ones((total_bytes // 4,), dtype=mx.float32)
    mx.eval(a)
    timing = time_call(lambda: a * 2, warmup, reps)
    moved = 2 * a.nbytes
    return {"array_bytes": a.nbytes, "bytes_moved": moved, "median_s": timing["median_s"],
            "bandwidth_Bps": moved / timing["median_s"]}


def _git_commit() -> dict:
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None}
    return {"git_commit": commit, "git_dirty": bool(dirty)}


def environment(command: str) -> dict:
    """Where and when a result was measured: device name and kind, MLX and kvq versions, git commit (when the
    sources are a git checkout), the installed kvq distributions and the sources hashes their plugins report
    (:mod:`kvq.provenance`: kernel sources, for instance), UTC date, and the exact ``command``."""
    from .. import __version__

    return {
        "device": device_name(), "device_kind": device_kind(), "mlx": mx.__version__, "kvq": __version__,
        **_git_commit(), "distributions": provenance.distributions(), "sources_hashes": provenance.sources_hashes(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "command": command,
    }
