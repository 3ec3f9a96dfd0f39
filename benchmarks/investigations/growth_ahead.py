"""Decode memory above the caches with the compressed stores grown ahead of the flush (each layer on a step of its
own, :meth:`kvq.cache.KVQCache._schedule_growth`) and as before (every layer in the flush step), issue #52.

On CUDA, MLX keeps a kernel's inputs alive until the command buffer that ran it has completed; a store's growth is
one concatenation whose input is the layer's whole old store, so when all layers grew in one step the old stores of
several layers were alive together (``kvq bench capacity`` at 32K on an H100: 8.7 GB above turboquant:3's caches,
about five layers' stores). Runs ``kvq bench e2e`` in this process, the schedule switched off for ``at-flush``:

    python growth_ahead.py {ahead|at-flush} [kvq bench e2e options ...]

mlx-lm's KVCache row is left out (at a batch that shows the growth it would not fit). Compare the rows'
``peak_memory_growth`` with their ``kv_bytes`` (the timed steps must include a growth: with flush
128 and the store's step of 256, ``--steps 256`` does).
"""
import runpy
import sys

mode, rest = sys.argv[1], sys.argv[2:]
if mode not in ("ahead", "at-flush"):
    sys.exit(f"mode must be 'ahead' or 'at-flush'; got {mode!r}")
if mode == "at-flush":
    from kvq.cache import KVQCache

    KVQCache._schedule_growth = lambda self: None
# the rows of kvq's caches only: mlx-lm's KVCache at the batch that shows the growth would not fit
from kvq.bench import e2e  # noqa: E402

_parse = e2e.parse_methods
e2e.parse_methods = lambda *a, **k: [s for s in _parse(*a, **k) if s.label != e2e.REFERENCE]
sys.argv = ["kvq", "bench", "e2e", *rest]
runpy.run_module("kvq.cli", run_name="__main__")
