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
def tuned(attend: dict | None = None, streams: dict | None = None, prefill: dict | None = None) -> Iterator[None]:
    """Run the block with ``attend`` knobs (:class:`kvq_metal.knobs.AttendKnobs` fields), ``streams`` knobs
    (:class:`kvq_metal.knobs.StreamsKnobs` fields) and ``prefill`` knobs (:class:`kvq_metal.knobs.PrefillKnobs`)
    over the current ones; all put back afterwards.

    :raises TypeError: a knob the family does not have."""
    from kvq_metal import attend as attend_module, prefill as prefill_module, streams as streams_module

    saved = attend_module.TUNING, streams_module.TUNING, prefill_module.TUNING
    try:
        attend_module.TUNING = attrs.evolve(saved[0], **(attend or {}))
        streams_module.TUNING = attrs.evolve(saved[1], **(streams or {}))
        prefill_module.TUNING = attrs.evolve(saved[2], **(prefill or {}))
        yield
    finally:
        attend_module.TUNING, streams_module.TUNING, prefill_module.TUNING = saved


def knobs_arg(text: str) -> dict:
    """A ``--tuning``-style command-line argument: a JSON object of knob overrides (``'{"nt": 1}'``).

    :raises ValueError: not a JSON object."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"knob overrides must be a JSON object; got {text!r}")
    return value


def main() -> int:
    """``python benchmarks/knobs.py [--attend JSON] [--streams JSON] [--prefill JSON] -- KVQ ARGS...``: the ``kvq``
    command ``KVQ ARGS`` run inside :func:`tuned` (``-- bench prefill --model random:llama3-8b`` with ``--prefill
    '{"tc": true}'``: the prefill kernel on)."""
    import argparse
    import sys

    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    for family in ("attend", "streams", "prefill"):
        p.add_argument(f"--{family}", type=knobs_arg, default=None, help=f"{family} knob overrides (JSON object)")
    args = p.parse_args(argv[:cut])
    from kvq.cli import main as kvq_main

    with tuned(attend=args.attend, streams=args.streams, prefill=args.prefill):
        return kvq_main(argv[cut + 1:])


if __name__ == "__main__":
    raise SystemExit(main())
