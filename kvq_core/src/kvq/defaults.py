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
#: First tokens of a sequence a kvq cache keeps uncompressed (:class:`kvq.cache.CacheConfig`'s ``sinks``; StreamingLLM's
#: attention sinks, Xiao et al., arXiv 2309.17453, which keeps 4).
DEFAULT_SINKS = 4
#: Most recent tokens a kvq cache keeps uncompressed (:class:`kvq.cache.CacheConfig`'s ``window``; KIVI's residual
#: length, arXiv 2402.02750).
DEFAULT_WINDOW = 128

#: The cache kvq recommends (a method string of ``kvq eval``): perplexity within 1% of the reference on the three
#: models tested, at 4.06-4.44 bits per coordinate (``docs/results.md``, against mlx-lm's float32 KVCache at 2K:
#: +0.3% on SmolLM2-135M, +0.8% on Qwen2.5-Coder-0.5B, +0.9% on gemma-3-270m). The README's "Which to use" and
#: ``kvq demo`` name it from here.
RECOMMENDED = "turboquant:4"
#: The recommended cache of kvq-core alone (without kvq-backends-turboquant): 4.5 bits, +1.7% perplexity on
#: SmolLM2-135M at 2K.
RECOMMENDED_CORE = "affine:4"
#: The ~3-bit cache: 3.25 bits, +2.7% perplexity on SmolLM2-135M at 2K; ``kvq demo`` shows what it answers too.
THREE_BIT = "turboquant:3"
#: The ~3-bit cache of kvq-core alone (3.5 bits).
THREE_BIT_CORE = "affine:3"
