"""The window's schedule: which tokens are compressed when, in token-by-token decode, and so what each query row of a
prefill chunk sees compressed.

A layer keeps the newest ``window`` to ``window + flush - 1`` tokens (after its sinks) uncompressed: once the window
holds ``window + flush - 1`` and one more arrives, its oldest ``flush`` are compressed together. A chunk of ``T``
tokens leaves the cache exactly as ``T`` single-token updates would, and its query row ``r`` sees compressed exactly
the tokens a token-by-token run had compressed when row ``r``'s token arrived (:func:`visible`), uncompressed the
rest. This is the rule the attention engine (:mod:`kvq.cache.engine`) is given as per-row intervals.
"""

from __future__ import annotations

import attrs
import numpy as np


def leaving(held: int, new: int, window: int, flush: int) -> int:
    """Tokens that leave a window holding ``held`` tokens when ``new`` join it, as ``new`` single-token updates would
    have it: the window grows to ``window + flush - 1`` tokens, then its oldest ``flush`` are compressed together; so
    a multiple of ``flush`` (0 while fewer than ``window + flush`` are held)."""
    return flush * max(0, (held + new - window) // flush)


def most_held(window: int, flush: int) -> int:
    """The most tokens a window of ``window`` holds uncompressed after its sinks (:func:`leaving`):
    ``window + flush - 1``, reached just before a flush."""
    return window + flush - 1


def first_flush(sinks: int, window: int, flush: int) -> int:
    """How many tokens a layer holds when its first tokens are compressed (:func:`leaving`): the ``sinks``, then
    :func:`most_held` and one more; fewer tokens are all kept in 16 bits."""
    return sinks + most_held(window, flush) + 1


@attrs.frozen
class Fresh:
    """What attention needs from the chunk just stored, to give each of its query rows what a token-by-token run
    would show it: ``start`` the position of the chunk's first token after the sinks, ``compressed`` and ``held``
    the tokens that had left the window and those it held before the chunk, ``new`` the chunk's tokens after the
    sinks, ``dense`` the window before the chunk followed by those tokens, uncompressed (keys, values
    ``[B, H, held + new, D]``). A rotating cache also keeps ``encoded``, its ring before the chunk (oldest first)
    followed by the tokens the chunk compressed (keys, values :class:`kvq.Encoded`; ``None`` if neither has any),
    and ``encoded_first``, the index of its first token among the tokens after the sinks."""

    start: int
    compressed: int
    held: int
    new: int
    dense: tuple
    encoded: tuple | None = None
    encoded_first: int = 0


def visible(fresh: Fresh, start_q: int, count: int, window: int, flush: int) -> np.ndarray:
    """Per query row at positions ``start_q .. start_q + count - 1``: the tokens after the sinks that a token-by-token
    run had compressed when that row's token arrived (those compressed before the chunk, plus :func:`leaving` of the
    chunk's tokens added by then; all rows at once: a chunk's rows times the model's layers, per chunk, made one
    Python call per row cost as much as the attention). int64 ``[count]``, non-decreasing."""
    added = np.clip(np.arange(start_q, start_q + count) - fresh.start + 1, 0, fresh.new)
    return fresh.compressed + flush * np.maximum(0, (fresh.held + added - window) // flush)


def growth_append(room: int, slot: int) -> int:
    """Which of the next ``room`` window appends before a flush grows the compressed stores for it (1-based), by a
    layer's ``slot`` (the order its cache was made in): the layers of a model then grow on different decode steps,
    so their replaced arrays (alive until the step has run, on CUDA) are not all alive together (issue #52); 0
    where there is no such append (``room`` < 1: the flush itself grows the stores). The rule of
    :meth:`kvq.cache.KVQCache._schedule_growth` and of a batch's packed rows
    (:meth:`kvq.cache.packed.PackedRows._schedule_growth`)."""
    return 1 + slot % room if room >= 1 else 0
