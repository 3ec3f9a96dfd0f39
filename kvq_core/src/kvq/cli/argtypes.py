"""argparse types shared by kvq's commands: each refuses a bad value with a message naming what is allowed
(argparse puts the option's name in front of it)."""

from __future__ import annotations

import argparse
import math


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
