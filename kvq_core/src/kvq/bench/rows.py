"""The row loop the repeated benchmarks share (``kvq bench prefill``, ``kvq bench batch``): every group (a prompt
length, a batch size), then every repetition, then every method string with the reference first (``kvcache``:
mlx-lm's own caches), each row compared with the reference row of its own repetition; and :func:`spread`, the
median and range of repeated values that their reports show."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

from tqdm import tqdm

from ..evaluation.spec import REFERENCE


def repeated_rows(groups: Sequence[Any], reps: int, specs: Sequence, prepare: Callable[[Any], Any],
                  measure: Callable[..., dict], add_ratios: Callable[[dict, dict | None], None], *, desc: str,
                  what: Callable[[Any], str], progress: bool = True,
                  on_row: Callable[[dict], None] | None = None, warmup: int = 0) -> list[dict]:
    """Measure ``len(groups) * reps * len(specs)`` rows in that order, each group's after ``warmup`` untimed
    repetitions of all its specs.

    :param prepare: ``prepare(group)``: what every row of the group shares (the prompt ids), made once.
    :param measure: ``measure(spec, group, rep, prepared, bar)`` -> the row (``row["error"]`` set when it failed);
        ``rep`` counts the timed repetitions from 0 and is ``None`` in a warm-up.
    :param add_ratios: ``add_ratios(row, reference)`` with the repetition's reference row (``None`` until one
        succeeded: specs list the reference first).
    :param desc: the progress bar's title; :param what: ``what(group)``, the group in the bar's text.
    :param on_row: called with every timed row as it is measured (results files are written after each).
    :param warmup: repetitions of every spec run first in each group (they compile kernels for its shapes) and
        thrown away: neither returned nor handed to ``on_row``.
    :return: the timed rows.
    """
    rows = []
    bar = tqdm(total=len(groups) * (warmup + reps) * len(specs), desc=desc, unit="row", disable=not progress,
               dynamic_ncols=True)
    with bar:
        for group in groups:
            prepared = prepare(group)
            for turn in range(warmup + reps):
                rep = turn - warmup if turn >= warmup else None
                reference = None
                for spec in specs:
                    label = f"warm-up {turn + 1}" if rep is None else f"rep {rep + 1}"
                    bar.set_postfix_str(f"{what(group)}, {label}: {spec.label}")
                    row = measure(spec, group, rep, prepared, bar)
                    bar.update(1)
                    if rep is None:
                        continue
                    reference = reference or (row if spec.label == REFERENCE and not row["error"] else None)
                    add_ratios(row, reference)
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
    return rows


def spread(values: Sequence[float]) -> dict:
    """Repeated measurements of one quantity: ``{"median", "min", "max", "all"}`` (``all`` in the order given);
    without any value every entry is ``None`` and ``all`` empty."""
    values = [float(v) for v in values]
    if not values:
        return {"median": None, "min": None, "max": None, "all": []}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}
