"""The MLX graph one prefill chunk builds per layer, op by op, and the host time to build it (issue #51: a chunk's
host work against fp16's).

For each method, one layer's cache is filled to ``--context`` tokens (random keys and values), then one chunk of
``--chunk`` tokens is stored and attended (``update_and_fetch`` + ``attend``, the path a prefill on a GPU takes:
:func:`kvq.cache.prefill.attend_dequantized`), nothing evaluated: the graph's nodes are counted by primitive
(``mx.export_to_dot``) for the update and the attention apart, and the median host seconds of building each
(``--reps``) are recorded. ``kvcache`` is mlx-lm's ``KVCache`` with ``mx.fast.scaled_dot_product_attention``
(causal), the reference. Every node is work MLX's evaluation walks and, for most, a kernel it encodes and launches:
on an H100 a kvq chunk's host graph building measured 1.6-2.2 ms per layer at 8K against fp16's whole layer at
about 1.7 ms (``benchmarks/results/prefill/2026-12-06-h100-parts/README.md``).

On a GPU the counts are MLX's own. ``--emulate-cuda`` runs the CUDA path on a machine without a GPU: kvq_metal
believes the device is CUDA, ``mx.fast.cuda_kernel`` returns zeros of the output shapes, first-use checks pass and
the queued attention is not evaluated. MLX then builds the CPU's forms of its own ops, which decompose where the
GPU has one primitive (``mx.dequantize``: shifts and broadcasts; the fused attention: matmuls and a softmax), so
those counts are upper bounds; kvq's own ops and kernels are as on the GPU.

    python benchmarks/investigations/chunk_graph.py OUT_DIR [--methods kvcache,turboquant:3,affine:4]
        [--contexts 8K] [--chunk 2048] [--emulate-cuda] (and prefill_parts.py's layer options)

Writes OUT_DIR/chunk_graph.json.
"""

from __future__ import annotations

import collections
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parents[1]))  # benchmarks/: the layer setup prefill_parts.py times
from prefill_parts import _size, filled_copies, layer_inputs, layer_parser, layer_source  # noqa: E402


def emulate_cuda() -> None:
    """Make the CUDA path run on the CPU (module docstring): the patches last for the process."""
    class Recorder:
        def __init__(self, **build) -> None:
            self.name = build.get("name")

        def __call__(self, *, output_shapes, output_dtypes, **_):
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    mx.fast.cuda_kernel = lambda **build: Recorder(**build)
    import kvq.problem
    import kvq.selection

    cpu_kind = kvq.problem.device_kind

    def kind(device=None):
        k = cpu_kind(device)
        return "cuda" if k == "cpu" else k

    kvq.problem.device_kind = kvq.selection.device_kind = kind
    import kvq_metal  # noqa: F401  (its modules, loaded before patching their names)
    from kvq.cache import prefill
    from kvq.cache.layer import KVQCache
    from kvq.plugins import registry

    registry()  # every plugin's kernel modules imported
    for name, module in list(sys.modules.items()):
        if name.startswith("kvq_"):
            if hasattr(module, "gpu_backend"):
                module.gpu_backend = lambda: "cuda"
            if hasattr(module, "first_use_check"):
                module.first_use_check = lambda *a, **k: True
    KVQCache._prefill_on_device = lambda self, queries: self._chunk_fused()  # the GPU's rule
    prefill.InFlight.push = lambda self, out: None


def node_counts(arrays: list) -> dict:
    """Primitive name -> number of nodes in the graph of ``arrays`` (not evaluated)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(path), *arrays)
        text = path.read_text()
    return dict(collections.Counter(re.findall(r'label\s*=\s*"([A-Za-z_]+)', text)).most_common())


def measure(method: str, context: int, args, source, reps: int) -> dict:
    """One method's row: node counts of the update and of the attention, and their median build milliseconds.
    The layer's inputs and filled copies are ``prefill_parts.py``'s (the chunk's breakdown these counts explain)."""
    from kvq.bench.fill import cache_arrays, fill

    q, k_new, v_new, k_all, v_all = layer_inputs(args, source, context)
    scale = args.head_dim ** -0.5
    if method in ("kvcache", "fp16"):
        from mlx_lm.models.cache import KVCache

        def filled():
            c = KVCache()
            c.update_and_fetch(k_all[:, :, :context], v_all[:, :, :context])
            mx.eval(c.keys, c.values)
            return c

        def update(c):
            return list(c.update_and_fetch(k_new, v_new))

        def attend(c, kv):
            return [mx.fast.scaled_dot_product_attention(q, kv[0], kv[1], scale=scale, mask="causal")]
    else:
        from kvq.evaluation.spec import make_layer_cache, parse_method

        template = make_layer_cache(parse_method(method), sinks=4, window=128)
        fill([template], source, context, args.chunk)
        copies = filled_copies(template, reps + 1)

        def filled():
            return copies.pop()

        def update(c):
            c.update_and_fetch(k_new, v_new)
            return cache_arrays(c)

        def attend(c, kv):
            return [c.attend(q, scale)]

    row = {"method": method, "context": context, "chunk": args.chunk}
    c = filled()
    stored = update(c)
    row["update_nodes"] = node_counts(stored)
    mx.eval(stored)
    row["attend_nodes"] = node_counts(attend(c, stored))
    times = {"update": [], "attend": []}
    for _ in range(reps):
        c = filled()
        tic = time.perf_counter()
        stored = update(c)
        times["update"].append(time.perf_counter() - tic)
        tic = time.perf_counter()
        out = attend(c, stored)  # built, never evaluated
        times["attend"].append(time.perf_counter() - tic)
        mx.eval(stored)
        del c, stored, out  # freed here, not inside the next repetition's timers (freeing 10K tokens took ~3 ms)
    for part, seconds in times.items():
        row[f"{part}_build_ms"] = 1e3 * statistics.median(seconds)
        row[f"{part}_node_total"] = sum(row[f"{part}_nodes"].values())
    return row


def main(argv=None) -> int:
    ap = layer_parser(__doc__, "8K")
    ap.add_argument("--methods", default="kvcache,turboquant:3,turboquant:4,affine:4")
    ap.add_argument("--emulate-cuda", action="store_true", help="the CUDA path on a machine without a GPU")
    args = ap.parse_args(argv)
    if args.emulate_cuda:
        emulate_cuda()
    _, source = layer_source(args)
    rows = []
    for context in [_size(c) for c in args.contexts.split(",")]:
        for method in [m.strip() for m in args.methods.split(",")]:
            row = measure(method, context, args, source, args.reps)
            rows.append(row)
            print(f"{context:7d} {method:14s} update {row['update_node_total']:4d} nodes "
                  f"{row['update_build_ms']:6.3f} ms   attend {row['attend_node_total']:4d} nodes "
                  f"{row['attend_build_ms']:6.3f} ms", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chunk_graph.json").write_text(json.dumps(
        {"rows": rows, "emulated_cuda": args.emulate_cuda, "mlx": mx.__version__, "device": str(mx.default_device()),
         "command": " ".join(sys.argv)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
