"""Reports of ``kvq eval``: a markdown table per context, the JSON document, and the quality-vs-bits plot."""

from __future__ import annotations

import json
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..install_hints import install_command

MIB = 2**20
COLUMNS = ("method", "bits/coord K, V (eff.)", "PPL", "ΔPPL", "KL", "top-1", "attn err mean / max", "needle",
           "KV MiB (x kvcache)", "measured MiB (x kvcache)", "s / window")


def versions() -> dict:
    """Versions of Python, the platform and the packages the numbers depend on."""
    import mlx.core as mx

    from ..provenance import distributions

    found = {"python": sys.version.split()[0], "platform": platform.platform(), "mlx_device": str(mx.default_device())}
    found.update(distributions())  # every kvq distribution and plugin installed (kvq-metal, vecinfer ...)
    for dist in ("mlx", "mlx-lm", "transformers"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return found


def _row(r: dict) -> list[str]:
    needle = r["needle"]["rate"]
    seconds = r["seconds"]
    per_window = (sum(seconds["prefill"]) + sum(seconds["score"])) / len(seconds["prefill"])
    key, value = r["key_bits_per_coordinate"], r["value_bits_per_coordinate"]
    bits = f"{key:.3g}" if key == value else f"{key:.3g}, {value:.3g}"
    return [
        r["method"], f"{bits} ({r['effective_bits_per_coordinate']:.3g})", f"{r['ppl']:.3f}",
        f"{100 * r['ppl_change']:+.1f}%", f"{r['kl']:.4f}", f"{100 * r['top1_agreement']:.1f}%",
        f"{r['attention_error']['mean']:.4f} / {r['attention_error']['max']:.4f}",
        "-" if needle is None else f"{sum(t['match'] for t in r['needle']['trials'])}/{len(r['needle']['trials'])}",
        f"{r['kv_bytes'] / MIB:.1f} ({r['kv_bytes_ratio']:.2f})",
        f"{r['active_memory_growth'] / MIB:.1f} ({r['memory_ratio']:.2f})", f"{per_window:.1f}",
    ]


def markdown_table(rows: list[dict]) -> str:
    """The rows of one context as a markdown table (the reference, kvcache, first)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_row(r)) + " |" for r in rows]
    return "\n".join(lines)


def markdown(document: dict) -> str:
    """All contexts of a run: a heading, the settings in one line, and a table each; then the notes."""
    parts = []
    for run in document["runs"]:
        s = run["settings"]
        parts.append(f"### {s['context']} tokens of context, {s['windows']} window{'s' * (s['windows'] != 1)} x "
                     f"{s['score_tokens']} scored tokens (offsets {', '.join(map(str, run['offsets']))}), needle depths "
                     f"{', '.join(f'{d:g}' for d in s['needle_depths']) or 'none'}\n")
        parts.append(markdown_table(run["rows"]) + "\n")
        for r in run["rows"]:
            if r.get("outlier_layers"):
                layers = "layer" if len(r["outlier_layers"]) == 1 else "layers"
                parts.append(f"{r['method']}: {layers} {', '.join(map(str, r['outlier_layers']))} stored with affine:8 "
                             "(outlier layers, kvq.cache.guard); bits/coord averages every layer.\n")
            if r.get("layer_bits_each"):
                parts.append(f"{r['method']}: bits/coord of keys / values per layer (a bits budget, kvq.cache.budget): "
                             f"{_per_layer(r['layer_bits_each'])}.\n")
            if r.get("centred_layers"):
                layers = "layer" if len(r["centred_layers"]) == 1 else "layers"
                parts.append(f"{r['method']}: keys of {layers} {', '.join(map(str, r['centred_layers']))} stored "
                             "centred (kvq.cache.guard; the mean counted in bits/coord).\n")
            if r.get("scaled_layers"):
                layers = "layer" if len(r["scaled_layers"]) == 1 else "layers"
                parts.append(f"{r['method']}: keys of {layers} {_ranges(r['scaled_layers'])} stored with channel scales "
                             "(kvq.cache.guard; the scales counted in bits/coord).\n")
    parts.append(NOTES)
    return "\n".join(parts)


def _per_layer(bits: list) -> str:
    """``[[k, v], ...]`` per layer -> ``"0-3, 5: 4.06 / 2.94; 4: 8.5 / 8.5"`` (layers of one setting together)."""
    groups: dict[str, list[int]] = {}
    for i, (k, v) in enumerate(bits):
        groups.setdefault(f"{k:.3g} / {v:.3g}", []).append(i)
    return "; ".join(f"layer{'s' * (len(ix) > 1)} {_ranges(ix)}: {label}" for label, ix in groups.items())


def _ranges(indices: list[int]) -> str:
    spans, start = [], indices[0]
    for a, b in zip(indices, indices[1:] + [None]):
        if b != a + 1:
            spans.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(spans)


NOTES = """Columns: bits/coord = stored bits per coordinate of compressed tokens (codes + norms + scales; sinks and \
window excluded), for keys and values; eff. = averaged over the context with sinks and window counted at 16 bits. \
ΔPPL and KL(kvcache || method) are against the reference, kvcache (mlx-lm's KVCache in the model's dtype; before \
2026-12-05 the reference was fp16, kvq's 16-bit cache), on the same tokens; top-1 = argmax agreement with it. \
attn err = relative error of each layer's attention output on the reference run's keys, values and queries (window 0, \
scored tokens), mean and max over layers. needle = greedy exact matches. KV MiB = the caches' nbytes after \
prefill; measured = growth of mx.get_active_memory() while filling; ratios are to the reference. s / window = prefill + \
scoring seconds per window."""


def markdown_file(document: dict) -> str:
    """A results file: title, the exact command, model, text and versions, then :func:`markdown`."""
    meta = document["meta"]
    found = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    lines = [f"# kvq eval, {meta['date']}", "", f"`{meta['command']}`", "",
             f"Model: {meta['model']} ({meta['model_dtype']}). Text: {meta['text']}, {meta['text_tokens']} tokens.",
             *([f"Each window and needle prompt starts with the BOS token (id {meta['bos'][0]}), which the "
                "tokenizer adds to every text."] if meta.get("bos") else []),
             f"Versions: {found}.", *(f"Note: {note}." for note in meta["notes"]), "", markdown(document)]
    return "\n".join(lines) + "\n"


def write_json(document: dict, path: str | Path) -> None:
    """Write the document (``{"meta": ..., "runs": [...]}``) as indented JSON."""
    Path(path).write_text(json.dumps(document, indent=2) + "\n")


def plot(document: dict, path: str | Path) -> None:
    """Quality vs bits per coordinate: PPL change and KL per method, one row of panels per context.

    :raises ValueError: matplotlib is not installed (``pip install 'kvq-core[plots]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError(f"--plot needs matplotlib ({exc}): {install_command('kvq-core', extra='plots')}") from None
    runs = document["runs"]
    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 4.5 * len(runs)), squeeze=False)
    for (ax_ppl, ax_kl), run in zip(axes, runs):
        for r in run["rows"]:
            x = r["bits_per_coordinate"]
            marker = "s" if r["cache"].startswith("mlx") else "o"
            for ax, y in ((ax_ppl, 100 * r["ppl_change"]), (ax_kl, r["kl"])):
                ax.scatter(x, y, marker=marker)
                ax.annotate(r["method"], (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        context = run["settings"]["context"]
        ax_ppl.set(xlabel="bits per coordinate (K, V mean; sinks/window excluded)", ylabel="PPL change vs kvcache (%)",
                   title=f"perplexity change, {context} context", yscale="symlog")
        ax_kl.set(xlabel="bits per coordinate (K, V mean; sinks/window excluded)", ylabel="mean KL(kvcache || method)",
                  title=f"KL divergence, {context} context", yscale="symlog")
        ax_kl.set_yscale("symlog", linthresh=1e-4)
        for ax in (ax_ppl, ax_kl):
            ax.grid(alpha=0.3)
    squares = any(r["cache"].startswith("mlx") for run in runs for r in run["rows"])
    fig.suptitle(f"kvq eval: {document['meta']['model']}"
                 + (" (squares: mlx-lm's own QuantizedKVCache)" if squares else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
