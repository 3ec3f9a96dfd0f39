"""Which single-sequence caches may share a batch's packed store (:class:`kvq.cache.packed.PackedRows`): the one
rule, asked when a batch packs its rows for decode and when rows join a pack."""

from __future__ import annotations


def _same_settings(a, b) -> bool:
    """Whether two layers' configurations agree on everything but what a layer's first compression fits (its
    parameters, the outlier-layer mark): a row that has compressed nothing yet may join rows that have."""
    return (a.sinks, a.window, a.step, a.flush, a.kernels, a.outlier_layers, a.budget, a.still_channels,
            a.key_params.method, a.value_params.method) == (
        b.sinks, b.window, b.step, b.flush, b.kernels, b.outlier_layers, b.budget, b.still_channels,
        b.key_params.method, b.value_params.method)


def packable(rows: list, minimum: int = 2, template=None) -> bool:
    """Whether ``rows`` (single-sequence caches) can be packed (with ``template``'s rows, when given: a
    :class:`kvq.cache.packed.PackedRows`): at least ``minimum`` rows of one packable class (``PACKABLE``: plain
    :class:`kvq.cache.KVQCache` rows) of one sequence each (a single row decodes as fast alone) of one layout and
    flush, no chunk pending, sinks full and a window allocated; the rows that hold compressed tokens (at least one
    of them, or the template's) of one configuration and parameters, the others (their first compression still to
    come) of the same settings (:func:`_same_settings`)."""
    if len(rows) < max(1, minimum):
        return False
    first = rows[0]
    if first.layout is None or first.layout[0] != 1:
        return False
    compressed = [r for r in rows if r.compressed_keys.length]
    if template is not None:
        config, params, layout = template.config, tuple(template.params), (1, *template.layout[1:])
    elif compressed:
        ref = compressed[0]
        config, params, layout = ref.config, (ref.compressed_keys.params, ref.compressed_values.params), ref.layout
    else:
        return False
    for row in rows:
        if (type(row) is not type(first) or not type(row).PACKABLE or row.layout != layout or row.pending_chunk
                or row.sinks.length < row.config.sinks or row.window.keys is None):
            return False
        if row.compressed_keys.length:
            if row.config != config or (row.compressed_keys.params, row.compressed_values.params) != params:
                return False
        elif not _same_settings(row.config, config) or row.config.flush_tokens != config.flush_tokens:
            return False
    return True
