"""``kvq bench capacity``: the largest batch of equal-length sequences that fits in one device's memory with each
cache, and its aggregate decode tokens/s (issue #22's capacity benchmark: the number a server operator cares about).

Per method (kvcache, mlx-lm's KVCache, first): two probes of :class:`kvq.bench.e2e.E2EBench` rows at 1 and 2
sequences give the peak memory above the model as ``a + b * B`` (``b``: one more sequence's cache and decode
temporaries, at least the probe's cache bytes per sequence: on an H100, mlx-lm's KVCache at 32K peaked 2.3 GB apart
at 1 and 2 sequences where each holds 4.3 GB, and the batch predicted from that slope did not fit); the largest
``B`` whose predicted peak stays within the budget, times a safety factor, is then measured like a ``kvq bench e2e
--batch B`` row (random keys and values in every row, one token per sequence per step, flushes included). A measured
peak above the budget, or a failed row, steps ``B`` down by a tenth and measures again (at most :data:`MAX_TRIES`
times); once one fits, the gap up to the smallest batch that did not is halved while it is wider than a thirty-
second of the fitting batch (:meth:`CapacityBench._narrow`). A batch that fits at once gives a third point: the line
through the probe at 1 and its measured peak predicts again (the slope of two probes at 1 and 2 sequences is noisy:
one more sequence's bytes moved by half between two runs on a CPU), and a larger prediction is measured too and kept
if it fits, so a cautious first prediction does not understate a cache. A batch at ``max_batch`` is marked
(``at_max_batch``): more might fit. The chosen batch's decode is timed ``reps`` times (the row that showed it fits,
then ``reps - 1`` more rows at that batch); a repetition that fails or peaks above the budget means the batch does
not fit after all, and ``B`` steps down a tenth and is measured again (on an H100 turboquant:4's search chose 54
sequences whose first row peaked within the budget, and its second repetition ran out of device memory). Each
repetition's tokens/s, ms per step (the timed steps' mean) and host ms per step (their median, as
:func:`kvq.bench.fill.host_summary`) are in ``reps``, and their medians and ranges beside them. Every ratio compares
with the kvcache row of the same run (the medians'; kvcache's repetitions ran before the method's, minutes apart,
not in turn).
"""

from __future__ import annotations

from typing import Callable

import attrs
import mlx.core as mx
from tqdm import tqdm

from ..defaults import DEFAULT_FLUSH, DEFAULT_SINKS, DEFAULT_WINDOW
from .e2e import REFERENCE, E2EBench, E2ESettings
from .measure import release
from .output import uncompressed_note
from .rows import spread

#: Batches measured per method after the probes, at most (each a tenth below the last that did not fit, in its
#: first row or in a repetition; after a larger batch whose repetition failed, the one that fitted before it).
MAX_TRIES = 3

#: Batches measured between the largest that fitted and the smallest above it that did not, at most, per fit
#: (:meth:`CapacityBench._narrow`).
MAX_NARROW = 3


@attrs.frozen
class CapacitySettings:
    """What one ``kvq bench capacity`` run measures.

    :param context: tokens held by every sequence (> 0).
    :param budget: bytes the run may hold in all: the model, the caches and the decode temporaries (> 0; the
        CLI's default is the device's memory, ``mx.device_info()``).
    :param safety: fraction of the predicted headroom the chosen batch may use (0 < safety <= 1).
    :param max_batch: the largest batch tried (>= 1).
    :param reps: timed rows at the chosen batch (>= 1; the first is the one that showed it fits).
    :param steps, warmup, chunk, sinks, window, kernels, flush, seed: as :class:`kvq.bench.e2e.E2ESettings`.
    :param progress: show a tqdm bar on stderr.
    """

    context: int
    budget: int
    safety: float = 0.9
    max_batch: int = 1024
    steps: int = 16
    reps: int = 2
    warmup: int = 1
    chunk: int = 4096
    sinks: int = DEFAULT_SINKS
    window: int = DEFAULT_WINDOW
    kernels: str = "auto"
    flush: int = DEFAULT_FLUSH
    seed: int = 0
    progress: bool = True

    def __attrs_post_init__(self) -> None:
        for name, value, low in (("context", self.context, 1), ("budget", self.budget, 1),
                                 ("max_batch", self.max_batch, 1), ("steps", self.steps, 1), ("reps", self.reps, 1)):
            if value < low:
                raise ValueError(f"{name} must be >= {low}; got {value}")
        if not 0 < self.safety <= 1:
            raise ValueError(f"safety must be in (0, 1]; got {self.safety}")

    def e2e(self, batch: int, steps: int) -> E2ESettings:
        """The :class:`E2ESettings` of one measured row at ``batch`` sequences."""
        return E2ESettings(contexts=(self.context,), steps=steps, warmup=self.warmup, chunk=self.chunk,
                           sinks=self.sinks, window=self.window, kernels=self.kernels, seed=self.seed,
                           progress=False, flush=self.flush, batch=batch)


def notes(settings: CapacitySettings) -> list[str]:
    """What a reader of the results must know about ``settings``: sequences that never grow past a kvq cache's
    sinks and window (with the steps decoded) compress nothing, so its rows then measure 16-bit caches."""
    return uncompressed_note(f"sequences of {settings.context} tokens (+ {settings.steps} decoded)",
                             settings.context + settings.steps, settings.sinks, settings.window, settings.flush,
                             "--context")


def predicted_batch(probes: dict[int, int], headroom: int, safety: float, max_batch: int,
                    least_per_sequence: float = 1.0) -> int:
    """The largest batch whose peak, on the line through the probes' peaks (``{batch: peak bytes}`` at two batch
    sizes), stays within ``safety * headroom`` bytes; at least 1, at most ``max_batch``. The line's slope (bytes one
    more sequence adds) is taken as at least ``least_per_sequence`` bytes: a cache's own bytes per sequence bound it
    from below, and two probes' peaks can understate it (prefill temporaries that do not grow with the batch).

    :raises ValueError: fewer than two probes.
    """
    if len(probes) < 2:
        raise ValueError(f"predicted_batch needs peaks at two batch sizes; got {sorted(probes)}")
    (b1, p1), (b2, p2) = sorted(probes.items())[:2]
    per_sequence = max((p2 - p1) / (b2 - b1), least_per_sequence, 1.0)
    fixed = p1 - per_sequence * b1
    return int(max(1, min(max_batch, (safety * headroom - fixed) // per_sequence)))


class CapacityBench:
    """Measures one row per method on one model (``run``), kvcache first.

    :param model: an mlx-lm llama-family model (as :class:`kvq.bench.e2e.E2EBench`).
    :param settings: :class:`CapacitySettings`.
    """

    def __init__(self, model, settings: CapacitySettings) -> None:
        self.model, self.settings = model, settings

    def run(self, specs: list, on_row: Callable[[dict], None] | None = None) -> list[dict]:
        """A row per spec (in order; kvcache first): ``method``, ``max_batch``, ``per_sequence_bytes``, the first
        measured row at that batch (``row``), its repetitions (``reps``: ``tokens_per_second`` for all sequences,
        ``step_ms``, ``host_ms``, ``peak_memory``, ``error`` each), their medians and ranges (``tokens_per_second``
        the median, ``tokens_per_second_spread``, ``step_ms``, ``host_ms``), ``peak_memory`` (the largest of the
        repetitions') and ratios to kvcache."""
        rows, reference = [], None
        for spec in tqdm(specs, desc="kvq bench capacity", unit="method", disable=not self.settings.progress):
            row = self._measure(spec)
            reference = reference or (row if spec.label == REFERENCE and not row["error"] else None)
            add_ratios(row, reference)
            rows.append(row)
            if on_row is not None:
                on_row(row)
        return rows

    def _row(self, spec, batch: int, steps: int) -> dict:
        release()
        (row,) = E2EBench(self.model, self.settings.e2e(batch, steps)).run([spec])
        release()
        return row

    def _measure(self, spec) -> dict:
        s = self.settings
        release()
        base = mx.get_active_memory()  # the model, and whatever else the process holds
        headroom = s.budget - base
        result = {"method": spec.label, "context": s.context, "budget": s.budget, "base_memory": base,
                  "probes": {}, "tries": [], "error": None}
        if headroom <= 0:
            result["error"] = f"the model alone holds {base:,} bytes, more than the budget of {s.budget:,}"
            return result
        for batch in (1, 2):
            probe = self._row(spec, batch, 2)
            if probe["error"]:
                result["error"] = f"probe at {batch} sequences: {probe['error']}"
                return result
            result["probes"][batch] = probe["peak_memory"] - base
        peaks = result["probes"]
        result["per_sequence_bytes"] = peaks[2] - peaks[1]
        result["cache_bytes_per_sequence"] = probe["kv_bytes"] / 2  # the probe at 2 sequences' cache
        batch = predicted_batch(peaks, headroom, s.safety, s.max_batch, result["cache_bytes_per_sequence"])
        for attempt in range(MAX_TRIES):
            row = self._try(spec, batch, result)
            if row is not None:
                if attempt == 0 and 2 < batch < s.max_batch:  # fitted at once: predict again from it
                    self._try_larger(spec, batch, row, peaks[1], headroom, result)
                self._narrow(spec, result)
                if self._repeat(spec, result):
                    return result
                if self._unfit(result) > batch:
                    continue  # the larger batch's repetition did not fit: measure the one that fitted again
            if batch == 1:
                break
            batch = max(1, int(batch * 0.9))
        result["error"] = f"no batch from {result['tries'][0]['batch']} down fit the budget: {result['tries'][-1]}"
        return result

    def _try(self, spec, batch: int, result: dict) -> dict | None:
        """Measure ``batch`` sequences; record the try in ``result`` and, where it fits, the row (returned)."""
        row = self._row(spec, batch, self.settings.steps)
        fits = not row["error"] and row["peak_memory"] <= self.settings.budget
        result["tries"].append({"batch": batch, "peak_memory": row.get("peak_memory"), "error": row["error"]})
        if not fits:
            return None
        result.update(max_batch=batch, row=row, tokens_per_second=row["tokens_per_second"],
                      peak_memory=row["peak_memory"], kv_bytes=row["kv_bytes"],
                      at_max_batch=batch == self.settings.max_batch)
        return row

    def _try_larger(self, spec, batch: int, row: dict, peak_one: int, headroom: int, result: dict) -> None:
        """Measure the batch the line through the probe at 1 sequence and ``row`` (at ``batch``) predicts, where
        that is larger; it replaces ``row`` in ``result`` if it fits."""
        s = self.settings
        line = {1: peak_one, batch: row["peak_memory"] - result["base_memory"]}
        larger = predicted_batch(line, headroom, s.safety, s.max_batch, result["cache_bytes_per_sequence"])
        if larger > batch:
            self._try(spec, larger, result)


    def _narrow(self, spec, result: dict) -> None:
        """Where a batch above the largest that fitted (``result["max_batch"]``) did not fit (in its first row or a
        repetition, as ``result["tries"]`` records), measure the batch halfway between them, and again, until they
        are at most a thirty-second of the fitting batch apart (or one sequence) or :data:`MAX_NARROW` batches were
        measured. A tenth's step down from a batch that ran out of memory otherwise undercounts: on an H100 the
        line through turboquant:3's probes predicted 71 sequences of 32K, 71 ran out of memory, the search stepped
        down to 63, and 69 had fitted in the previous day's run."""
        budget = self.settings.budget
        for _ in range(MAX_NARROW):
            fitted = result["max_batch"]
            unfit = [t["batch"] for t in result["tries"]
                     if t["batch"] > fitted and (t["error"] or (t["peak_memory"] or 0) > budget)]
            if not unfit or min(unfit) - fitted <= max(1, fitted // 32):
                return
            self._try(spec, (fitted + min(unfit)) // 2, result)

    def _repeat(self, spec, result: dict) -> bool:
        """Time the chosen batch ``reps - 1`` more times; put every repetition (``result["row"]`` first) and their
        medians and ranges in ``result``. True where every repetition ran within the budget; else the failing one is
        recorded in ``result["tries"]`` and False returned (the batch does not fit: :meth:`_unfit`)."""
        s = self.settings
        rows = [result["row"]]
        for _ in range(s.reps - 1):
            row = self._row(spec, result["max_batch"], s.steps)
            if row["error"] or row["peak_memory"] > s.budget:
                result["tries"].append({"batch": result["max_batch"], "peak_memory": row.get("peak_memory"),
                                        "error": row["error"] or "a repetition peaked above the budget",
                                        "repetition": len(rows) + 1})
                return False
            rows.append(row)
        reps = [repetition(r) for r in rows]
        result.update(reps=reps, tokens_per_second_spread=spread([r["tokens_per_second"] for r in reps]),
                      step_ms=spread([r["step_ms"] for r in reps]),
                      host_ms=spread([r["host_ms"] for r in reps if r["host_ms"] is not None]),
                      build_ms=spread([r["build_ms"] for r in reps if r.get("build_ms") is not None]),
                      peak_memory=max(r["peak_memory"] for r in reps))
        result["tokens_per_second"] = result["tokens_per_second_spread"]["median"]
        return True

    @staticmethod
    def _unfit(result: dict) -> int:
        """Take back what :meth:`_try` recorded for a batch whose repetition did not fit; return that batch."""
        for key in ("row", "tokens_per_second", "peak_memory", "kv_bytes", "at_max_batch"):
            result.pop(key, None)
        return result.pop("max_batch")


def repetition(row: dict) -> dict:
    """What one timed row at the chosen batch contributes: ``tokens_per_second``, ``step_ms`` (the mean step),
    ``host_ms`` (the median step's host time; ``None`` where not measured), ``peak_memory`` and ``error``."""
    if row["error"]:
        return {"tokens_per_second": None, "step_ms": None, "host_ms": None, "build_ms": None, "peak_memory": None,
                "error": row["error"]}
    return {"tokens_per_second": row["tokens_per_second"], "step_ms": row["latency_ms"]["mean"],
            "host_ms": (row.get("host_ms") or {}).get("median"),
            "build_ms": (row.get("build_ms") or {}).get("median"), "peak_memory": row["peak_memory"], "error": None}


def add_ratios(row: dict, reference: dict | None) -> None:
    """Add ``batch_vs_fp16`` and ``tokens_vs_fp16`` (method / kvcache, tokens/s the medians of their repetitions;
    ``None`` when either row failed)."""
    ok = reference is not None and not row["error"]
    row["batch_vs_fp16"] = row["max_batch"] / reference["max_batch"] if ok else None
    row["tokens_vs_fp16"] = row["tokens_per_second"] / reference["tokens_per_second"] if ok else None
