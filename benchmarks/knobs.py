"""Benchmarks' override of kvq_metal's launch knobs (:mod:`kvq_metal.knobs`).

The library plans its launches with frozen defaults (``kvq_metal.attend.TUNING``, ``kvq_metal.streams.TUNING``)
and reads no environment variable. A sweep runs its variants inside :func:`tuned`, which swaps a family's knobs for
an edited copy and puts the defaults back when the block ends (also on an error)::

    from knobs import tuned  # benchmarks/ is on sys.path when a script in it runs

    with tuned(attend={"nt": 1, "qsh": False}, streams={"kt": 8}):
        ...  # every plan made here uses these knobs

Plans are cached per knobs object, so the knobs apply to calls and bindings made inside the block; a decode step
bound inside it keeps its launch after the block. An unknown knob is an error (``TypeError`` from
``attrs.evolve``), so a sweep cannot silently run the defaults.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterator

import attrs


@contextmanager
def tuned(attend: dict | None = None, streams: dict | None = None) -> Iterator[None]:
    """Run the block with ``attend`` knobs (:class:`kvq_metal.knobs.AttendKnobs` fields) and ``streams`` knobs
    (:class:`kvq_metal.knobs.StreamsKnobs` fields) over the current ones; both put back afterwards.

    :raises TypeError: a knob the family does not have."""
    from kvq_metal import attend as attend_module, streams as streams_module

    saved = attend_module.TUNING, streams_module.TUNING
    try:
        attend_module.TUNING = attrs.evolve(saved[0], **(attend or {}))
        streams_module.TUNING = attrs.evolve(saved[1], **(streams or {}))
        yield
    finally:
        attend_module.TUNING, streams_module.TUNING = saved


def knobs_arg(text: str) -> dict:
    """A ``--tuning``-style command-line argument: a JSON object of knob overrides (``'{"nt": 1}'``).

    :raises ValueError: not a JSON object."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"knob overrides must be a JSON object; got {text!r}")
    return value
