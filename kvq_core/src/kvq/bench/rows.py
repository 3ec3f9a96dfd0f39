"""The row loop the repeated benchmarks share (``kvq bench prefill``, ``kvq bench batch``): every group (a prompt
length, a batch size), then every repetition, then every method string with the reference first (``kvcache``:
mlx-lm's own caches), each row compared with the reference row of its own repetition."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from tqdm import tqdm

from ..evaluation.spec import REFERENCE


def repeated_rows(groups: Sequence[Any], reps: int, specs: Sequence, prepare: Callable[[Any], Any],
                  measure: Callable[..., dict], add_ratios: Callable[[dict, dict | None], None], *, desc: str,
                  what: Callable[[Any], str], progress: bool = True,
                  on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Measure ``len(groups) * reps * len(specs)`` rows in that order.

    :param prepare: ``prepare(group)``: what every row of the group shares (the prompt ids), made once.
    :param measure: ``measure(spec, group, rep, prepared, bar)`` -> the row (``row["error"]`` set when it failed).
    :param add_ratios: ``add_ratios(row, reference)`` with the repetition's reference row (``None`` until one
        succeeded: specs list the reference first).
    :param desc: the progress bar's title; :param what: ``what(group)``, the group in the bar's text.
    :param on_row: called with every row as it is measured (results files are written after each).
    :return: the rows.
    """
    rows = []
    bar = tqdm(total=len(groups) * reps * len(specs), desc=desc, unit="row", disable=not progress,
               dynamic_ncols=True)
    with bar:
        for group in groups:
            prepared = prepare(group)
            for rep in range(reps):
                reference = None
                for spec in specs:
                    bar.set_postfix_str(f"{what(group)}, rep {rep + 1}: {spec.label}")
                    row = measure(spec, group, rep, prepared, bar)
                    reference = reference or (row if spec.label == REFERENCE and not row["error"] else None)
                    add_ratios(row, reference)
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
                    bar.update(1)
    return rows
