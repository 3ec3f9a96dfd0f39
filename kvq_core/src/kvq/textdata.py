"""Text that every Python install has: the Python language reference (``pydoc_data.topics``).

It is kvq's default evaluation and calibration text, so results are reproducible on a machine with no network.
The protocol of ../shared/REFERENCE_VALUES.md: topics sorted by key, joined by blank lines.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def language_reference() -> str:
    """The Python language reference text: ``pydoc_data.topics`` topics sorted by key, joined by blank lines.

    :return: about 0.9 MB of English text (its length depends on the Python version).
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))
