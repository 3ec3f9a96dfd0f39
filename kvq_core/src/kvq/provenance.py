"""What a result was made with, asked of whatever is installed: kvq's distributions and their plugins' sources.

kvq knows no plugin by name. A plugin that wants its sources recorded with benchmark results (kernel text, for
instance, whose revision a timing depends on) gives any object it hands to kvq an optional ``sources_hash()``:
its entry-point module (the module with ``kvq_register``) or an implementation object. :func:`sources_hashes`
asks every object registered with kvq's plugin manager.
"""

from __future__ import annotations

from importlib import metadata

from .plugins import GROUP, registry


def distributions() -> dict[str, str]:
    """Installed kvq distributions by name, with their versions: every ``kvq-*`` distribution and every
    distribution that declares plugins in the ``kvq`` entry-point group (``{"kvq-core": "0.1.0", ...}``)."""
    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name.startswith("kvq-") or any(ep.group == GROUP for ep in dist.entry_points):
            found[name] = dist.version
    return dict(sorted(found.items()))


def sources_hashes() -> dict[str, str | None]:
    """``sources_hash()`` of each object registered with kvq's plugin manager that defines one, keyed by its
    name there (``"entry-point:NAME"`` for a plugin's entry-point module, ``"METHOD:BACKEND"`` for an
    implementation). A ``sources_hash`` that raises is recorded as ``None`` (the result still says who had one)."""
    pm = registry().pm
    hashes = {}
    for plugin in pm.get_plugins():
        report = getattr(plugin, "sources_hash", None)  # kvq.contract.ReportsSources
        if callable(report):
            try:
                hashes[pm.get_name(plugin)] = str(report())
            except Exception:  # noqa: BLE001 - a broken plugin must not lose the measurement
                hashes[pm.get_name(plugin)] = None
    return dict(sorted(hashes.items()))
