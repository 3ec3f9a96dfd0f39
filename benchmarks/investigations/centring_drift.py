"""Does a first block's key mean stay the keys' mean? Per layer, over a long context (issue #53, kvq.cache.still).

A centred layer (kvq.cache.guard) subtracts the mean of the first block it compresses (tokens 4..260 here: 4 sinks,
then window 128 + flush 128) from every key it will compress. This measures, on a real model's keys (mlx-lm's own
cache, the language-reference text, BOS where the tokenizer adds one):

- ``share``: the block mean's share of the block's key energy (what the whole-mean rule compares with 0.8);
- ``a-b``: ``sum |k - mu|^2 / sum |k|^2`` over tokens a..b: below 1 the mean still removes energy there, above 1
  it adds some (the mean has turned away: RoPE turns each channel pair with position);
- ``still@H``: the block mean's energy share in the channels kvq.cache.still finds still over a horizon of H
  tokens (the layer's own RoPE module probed), and how many channels those are.

Sliding-window layers hold their last ``max_size`` tokens only: their spans are not measured here.

    uv run python benchmarks/investigations/centring_drift.py SmolLM2-135M-Instruct 8192
    uv run python benchmarks/investigations/centring_drift.py gemma-3-270m 2048

Findings (2026-12-05, CPU, float32): SmolLM2-135M (RoPE base 100,000, head_dim 64): shares 0.50-0.74, but from 4K
tokens on every layer's ratio is 0.96-1.54 (the mean adds energy), and at 8K only 0.03-0.13 of the energy is in
still channels: whole-mean centring there would hurt at long context, and kvq.cache.still centres none.
gemma-3-270m's global layers 5 and 11 (base 1,000,000, head_dim 256): shares 0.62 and 0.75, ratios 0.40-0.44 and
0.31-0.39 out to 2K, and 0.66 and 0.75 of the energy in channels still over 32K: centred. Qwen2.5-Coder-0.5B
(base 1,000,000): 0.84-0.99 still over 32K in its offset layers 0, 1, 2, 4 and 8.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

import kvq.models
from kvq import textdata
from kvq.cache.still import still_channels

SPANS = ((256, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 8192), (8192, 16384))
HORIZONS = (2048, 8192, 32768)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("context", type=int)
    parser.add_argument("--offset", type=int, default=30000, help="first text token (default 30000)")
    args = parser.parse_args()
    model, tokenizer = kvq.models.load(args.model, progress=False)
    text = textdata.encode_text(tokenizer, textdata.language_reference())
    ids = textdata.bos_ids(tokenizer) + text[args.offset : args.offset + args.context]
    cache = make_prompt_cache(model)
    prompt = mx.array(ids)[None]
    for start in range(0, len(ids), 512):
        model(prompt[:, start : start + 512], cache=cache)
        mx.eval([c.state for c in cache])
    spans = [s for s in SPANS if s[1] <= len(ids)]
    print(f"{args.model}, {len(ids)} tokens; block = tokens 4..260")
    print("layer  share  " + "  ".join(f"{a}-{b}" for a, b in spans) + "  " +
          "  ".join(f"still@{h}" for h in HORIZONS))
    for i, (layer, c) in enumerate(zip(model.layers, cache)):
        if type(c).__name__ != "KVCache":
            print(f"{i:5d}  (sliding window of {c.max_size})")
            continue
        keys = np.array(c.state[0].astype(mx.float32))[0]  # [H, T, D]
        block = keys[:, 4:260]
        mean = block.mean(1, keepdims=True)
        energy = (block**2).sum(-1).mean(-1).sum()
        share = (mean**2).sum() / energy
        ratios = [((keys[:, a:b] - mean) ** 2).sum() / (keys[:, a:b] ** 2).sum() for a, b in spans]
        still = []
        for horizon in HORIZONS:
            channels = list(still_channels(layer.self_attn.rope, keys.shape[-1], horizon) or ())
            still.append(f"{(mean[..., channels] ** 2).sum() / energy:.3f} ({len(channels)})")
        print(f"{i:5d}  {share:.3f}  " + "  ".join(f"{r:.3f}" for r in ratios) + "  " + "  ".join(still))


if __name__ == "__main__":
    main()
