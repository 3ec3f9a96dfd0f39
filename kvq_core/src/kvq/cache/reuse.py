"""Prompt-cache reuse that never changes an answer: mlx-lm's server reuses a kvq cache only where a trim is exact.

mlx-lm's server keeps the caches of finished requests (``mlx_lm.models.cache.LRUPromptCache``) and serves a new
request from the entry sharing its longest prefix; an entry longer than that prefix (the same question asked again:
the entry holds the question and its answer) is copied and trimmed back to the prefix. A kvq cache compresses a
window's oldest tokens when a flush comes due, and their 16-bit copies are gone: if the answer's tokens pushed the
window past a flush, the trimmed copy holds compressed some prompt tokens that a fresh run of the same request
holds uncompressed, and the same request got another answer (found by a new user: ``kvq serve --window 16
--flush 16``, one question asked four times, the fresh answer twice and another twice).

:meth:`kvq.cache.KVQCache.trims_exactly` says whether a trim leaves exactly what a fresh run of the remaining
tokens holds. Inside :func:`exact_trims` a kvq cache's ``trim`` raises :class:`InexactTrim` instead of trimming
otherwise; mlx-lm's ``LRUPromptCache`` (patched by :mod:`kvq.cache.patch`) then looks again as if kvq's caches
could not be trimmed (:func:`untrimmable`): it serves the request from the longest stored entry that is a prefix of
it, or from no cache (the server recomputes). Its ``insert_cache`` keeps those prefix entries for kvq caches (for
trimmable caches mlx-lm drops them, relying on trims): a finished request's entry then sits beside the entries at
its segment boundaries (system prompt, user turn), which later requests reuse exactly. Everything else (an exact
trim, other caches) is mlx-lm's own logic, unchanged; speculative decoding and direct ``trim`` calls trim as
before.
"""

from __future__ import annotations

import contextlib
import threading

_STATE = threading.local()


class InexactTrim(ValueError):
    """A kvq cache asked, inside :func:`exact_trims`, to trim where the result would differ from a fresh run."""


@contextlib.contextmanager
def _raised(flag: str):
    """Within this block, ``flag`` is set on this thread (and restored after it, nested blocks included)."""
    previous = getattr(_STATE, flag, False)
    setattr(_STATE, flag, True)
    try:
        yield
    finally:
        setattr(_STATE, flag, previous)


def exact_trims():
    """A context: within it (on this thread), kvq caches refuse inexact trims with :class:`InexactTrim`."""
    return _raised("exact")


def exact_required() -> bool:
    """Whether this thread is inside :func:`exact_trims`."""
    return getattr(_STATE, "exact", False)


def untrimmable():
    """A context: within it (on this thread), kvq caches answer ``is_trimmable()`` with ``False``."""
    return _raised("untrimmable")


def trimmable_now() -> bool:
    """What a kvq cache's ``is_trimmable()`` answers on this thread: ``False`` inside :func:`untrimmable`."""
    return not getattr(_STATE, "untrimmable", False)


def check_trim(cache, n: int) -> None:
    """:raises InexactTrim: inside :func:`exact_trims`, when ``cache.trim(n)`` would not be exact
    (:meth:`kvq.cache.KVQCache.trims_exactly`)."""
    if exact_required() and not cache.trims_exactly(n):
        raise InexactTrim(f"trimming {n} of {cache.offset} tokens would leave compressed tokens that a fresh run "
                          f"holds uncompressed")


def exact_fetch(original):
    """``LRUPromptCache.fetch_nearest_cache`` made to refuse inexact trims of kvq caches: same signature and result
    ``(cache or None, tokens still to process)``; where the nearest entry is a kvq cache that cannot be trimmed
    exactly to the shared prefix, the answer mlx-lm gives for caches that cannot be trimmed (the longest stored
    prefix of the request, or ``None``). The stored entry is untouched: mlx-lm trims a copy."""

    def fetch_nearest_cache(self, model, tokens):
        with exact_trims():
            try:
                return original(self, model, tokens)
            except InexactTrim:
                pass
        with untrimmable():
            return original(self, model, tokens)

    fetch_nearest_cache.__wrapped__ = original
    fetch_nearest_cache.__doc__ = exact_fetch.__doc__
    return fetch_nearest_cache


def prefix_keeping_insert(original):
    """``LRUPromptCache.insert_cache`` that keeps the stored prefixes of a kvq cache's tokens (mlx-lm drops them for
    trimmable caches): the entries :func:`exact_fetch` falls back to. Same signature and result."""

    def insert_cache(self, *args, **kwargs):
        with untrimmable():
            return original(self, *args, **kwargs)

    insert_cache.__wrapped__ = original
    insert_cache.__doc__ = prefix_keeping_insert.__doc__
    return insert_cache
