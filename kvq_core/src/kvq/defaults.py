"""Cache defaults that the library, the CLI and the benches share, in a module that imports nothing (the CLI reads
them without importing mlx-lm, which :mod:`kvq.cache` does)."""

from __future__ import annotations

#: Tokens that leave a kvq cache's residual window together (:class:`kvq.cache.CacheConfig`'s ``flush``): the
#: window grows to ``window + DEFAULT_FLUSH - 1`` tokens, then its oldest ``DEFAULT_FLUSH`` are compressed in one
#: quantize per side. 128, KIVI's residual length (arXiv 2402.02750): a step that compresses costs about 14 ms of
#: host work for 32 layers on an H200 (``benchmarks/results/host/README.md``), so one every 128 steps instead of
#: every 32 made decode 4-15% faster there on average per context
#: (``benchmarks/results/e2e/2026-12-03-h200-*-rounds-rep{1,2}.*``: the geometric mean over 6 rounds of the
#: tokens/s ratio to fp16 rose from 0.83-0.92 to 0.98-1.02 at 4K and from 0.90-0.96 to 0.95-1.01 at 128K), for 96
#: more uncompressed tokens per layer at most (12 MB at Llama-3-8B's shape).
DEFAULT_FLUSH = 128

#: The cache kvq recommends (a method string of ``kvq eval``): perplexity within 1% of the reference on both models
#: tested at 4.25 bits per coordinate (``docs/results.md``: +0.4% against mlx-lm's KVCache on SmolLM2-135M at 2K;
#: +0.7% against kvq's 16-bit cache on Qwen2.5-Coder-0.5B). The README's "Which to use" and ``kvq demo`` name it
#: from here.
RECOMMENDED = "turboquant:4"
#: The recommended cache of kvq-core alone (without kvq-backends-turboquant): +1.3% perplexity, 4.5 bits.
RECOMMENDED_CORE = "affine:4"
#: The ~3-bit cache: +3.0% perplexity at 3.25 bits; ``kvq demo`` shows what it answers too.
THREE_BIT = "turboquant:3"
#: The ~3-bit cache of kvq-core alone (3.5 bits).
THREE_BIT_CORE = "affine:3"
