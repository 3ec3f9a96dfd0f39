"""argparse types shared by kvq's commands: each refuses a bad value with a message naming what is allowed
(argparse puts the option's name in front of it); and the options several commands share."""

from __future__ import annotations

import argparse
import math

from ..defaults import DEFAULT_SINKS, DEFAULT_WINDOW


def add_layout_options(parser: argparse.ArgumentParser) -> None:
    """``--sinks`` and ``--window``: a kvq cache's uncompressed first and last tokens (ints, the library's defaults
    :data:`kvq.defaults.DEFAULT_SINKS` and :data:`~kvq.defaults.DEFAULT_WINDOW`), as ``kvq bench``, ``kvq eval`` and
    ``kvq fit`` take them."""
    parser.add_argument("--sinks", type=int, default=DEFAULT_SINKS,
                        help=f"kvq caches: uncompressed first tokens (default {DEFAULT_SINKS})")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                        help=f"kvq caches: uncompressed last tokens (default {DEFAULT_WINDOW})")


def positive_int(text: str) -> int:
    """An integer of at least 1. :raises argparse.ArgumentTypeError: anything else."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer of at least 1, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number of at least 0 (seconds, say). :raises argparse.ArgumentTypeError: anything else."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, not {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text}")
    return value
