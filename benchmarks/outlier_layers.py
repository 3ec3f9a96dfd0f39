"""Per layer of a real model: what kvq's key guard sees and each key method's attention error, raw and as kvq stores
the keys (issue #20).

    python benchmarks/outlier_layers.py OUT.json [--model Qwen2.5-Coder-0.5B-Instruct] [--tokens 1024]
        [--offset 5000] [--methods turboquant:4,turboquant:3,affine:4,affine:8]
    python benchmarks/outlier_layers.py --report OUT.json      (only writes OUT.md from an earlier OUT.json)

One forward pass over ``--tokens`` tokens of the Python language reference (from token ``--offset``) with mlx-lm's
KVCache records every layer's queries, keys and values. Per layer, on the keys of the first block a kvq cache would
compress (the 129 tokens after 4 sinks): :func:`kvq.cache.guard.offset_energy` (centred at >= ``CENTER_LIMIT``) and
:func:`kvq.cache.guard.channel_concentration` (stored at 8 bits at >= ``CONCENTRATION_LIMIT``); and, per method, the
relative error of the causal attention output when only the keys are quantized and dequantized (pure MLX): "raw"
quantizes the keys as they are, "kvq" as the guard stores them (centred on that block's mean where it centres,
the mean added back after dequantizing; affine:8 where it upgrades the layer). Writes OUT.json and a markdown
table OUT.md (one row per layer).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import mlx.core as mx


def markdown(doc: dict) -> str:
    """One row per layer: offset energy, centred, concentration, 8 bits, key norm, each method's attention error raw
    and as kvq stores the keys."""
    methods = list(doc["rows"][0]["attention_error"])
    lines = [f"Per layer of {doc['model']} ({doc['tokens']} tokens of the Python language reference from token "
             f"{doc['offset']}; MLX {doc['mlx']}): the keys' offset energy (centred at >= {doc['center_limit']}), "
             f"their largest one-channel share once centred (8 bits at >= {doc['concentration_limit']}), mean norm, "
             "and the relative attention-output error with only the keys quantized: raw -> as kvq stores them.", "",
             "| layer | offset energy | centred | concentration | 8 bits | key norm | " + " | ".join(methods) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(methods)]
    for r in doc["rows"]:
        errors = " | ".join(f"{r['attention_error'][m]:.3f} -> {r['kvq_attention_error'][m]:.3f}" for m in methods)
        lines.append(f"| {r['layer']} | {r['offset_energy']:.3f} | {'yes' if r['centred'] else ''} | "
                     f"{r['concentration']:.3f} | {'yes' if r['upgraded'] else ''} | {r['key_norm']:.1f} | {errors} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--report"]:
        path = Path(argv[1])
        path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--offset", type=int, default=5000)
    ap.add_argument("--methods", default="turboquant:4,turboquant:3,affine:4,affine:8")
    args = ap.parse_args(argv)

    import kvq.models
    from mlx_lm.models.cache import KVCache

    from kvq import select
    from kvq.cache.guard import (CENTER_LIMIT, CONCENTRATION_LIMIT, channel_concentration, key_mean, offset_energy,
                                 safe_params)
    from kvq.evaluation.spec import parse_method
    from kvq.plugins import registry
    from kvq.textdata import encode_text, language_reference

    model, tokenizer = kvq.models.load(args.model, progress=False)
    module = importlib.import_module(type(model).__module__)
    ids = mx.array(encode_text(tokenizer, language_reference())[args.offset : args.offset + args.tokens])
    calls, original = [], module.scaled_dot_product_attention

    def record(q, k, v, cache, scale, mask, sinks=None):
        calls.append((q, k, v, scale))
        return original(q, k, v, cache=cache, scale=scale, mask=mask, sinks=sinks)

    module.scaled_dot_product_attention = record
    try:
        model(ids[None], cache=[KVCache() for _ in model.layers])
    finally:
        module.scaled_dot_product_attention = original
    methods = []
    for label in args.methods.split(","):
        spec = parse_method(label)
        methods.append((label, registry().method(spec.key_method).make_params(**spec.key_params)))

    def roundtrip(x, p):
        encoded = select(p.method, x.shape, dtype=x.dtype, op="quantize", params=p, kernels="off").quantize(x, p)
        plan = select(p.method, x.shape, dtype=x.dtype, op="dequantize", params=p, kernels="off")
        return plan.dequantize(encoded, mx.float32)

    rows = []
    safe = safe_params()
    for layer, (q, k, v, scale) in enumerate(calls):
        q, k, v = (a.astype(mx.float32) for a in (q, k, v))
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        block = k[:, :, 4:133]
        row = {"layer": layer, "offset_energy": offset_energy(block), "concentration": channel_concentration(block),
               "key_norm": float(mx.mean(mx.linalg.norm(k, axis=-1))), "attention_error": {},
               "kvq_attention_error": {}}
        row["centred"] = row["offset_energy"] >= CENTER_LIMIT
        row["upgraded"] = row["concentration"] >= CONCENTRATION_LIMIT
        mean = key_mean(block) if row["centred"] else mx.zeros((1, 1, 1, 1))

        def error(keys):
            out = mx.fast.scaled_dot_product_attention(q, keys, v, scale=scale, mask="causal")
            return float(mx.linalg.norm(out - ref) / mx.linalg.norm(ref))

        for label, p in methods:
            row["attention_error"][label] = error(roundtrip(k, p))
            stored = safe if row["upgraded"] and p.bits < 8 else p
            row["kvq_attention_error"][label] = error(roundtrip(k - mean, stored) + mean)
        rows.append(row)
        errors = " ".join(f"{m} {e:.3f}->{row['kvq_attention_error'][m]:.3f}" for m, e in row["attention_error"].items())
        print(f"layer {layer:2d} offset energy {row['offset_energy']:.3f} concentration {row['concentration']:.3f} "
              f"key norm {row['key_norm']:6.1f} {'CENTRED ' if row['centred'] else ''}"
              f"{'8-BIT ' if row['upgraded'] else ''}{errors}", flush=True)
    doc = {"model": args.model, "tokens": args.tokens, "offset": args.offset, "center_limit": CENTER_LIMIT,
           "concentration_limit": CONCENTRATION_LIMIT, "mlx": mx.__version__, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    Path(args.out).with_suffix(".md").write_text(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
