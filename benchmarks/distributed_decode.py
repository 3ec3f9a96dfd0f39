"""Decode speed and KV memory per rank of a tensor-parallel random-weight Llama-3-8B-shaped model, mlx-lm's KVCache
(kvcache) against kvq's caches.

    # 2 NVIDIA GPUs (issue #10): 64K context, 32 layers
    mlx.launch --backend nccl -n 2 -- python benchmarks/distributed_decode.py --context 65536 \\
        --out benchmarks/results/distributed/$(date +%F)-h200x2-nccl-tp-64k.json
    # check on a CPU (about a minute on 2 cores)
    mlx.launch --backend ring -n 2 -- python benchmarks/distributed_decode.py --layers 2 --context 512 \\
        --steps 4 --out /tmp/distributed_decode.json

Every rank builds the same random-weight model of ``kvq.bench.random_model`` preset shape (default ``llama3-8b``:
32 layers, 32 query heads, 8 KV heads of 128, vocab 128256; ``--layers`` keeps the first N), lazily, then shards it
(``model.shard``: each rank holds ``8 / N`` KV heads) before its weights are materialised, so no rank ever holds the
whole model. Then, per method string (``kvq.evaluation.spec``; ``kvcache``, or ``fp16`` its older name, is mlx-lm's
own ``KVCache``, ``affine:4``, ``turboquant:4``, ``turboquant:3`` kvq caches), ``kvq.bench.e2e.E2EBench`` (the
measuring part of ``kvq bench e2e``):

1. fills every layer's cache to ``--context`` tokens by ``update_and_fetch`` of random normal keys and values in
   chunks of ``--chunk`` (this rank's KV heads; not a real prefill: attention over a long cache is what is timed,
   and a 64K prefill would dominate the run);
2. records the caches' ``nbytes`` and the growth of ``mx.get_active_memory()`` from before the caches existed;
3. times ``--steps`` greedy decode steps after ``--warmup`` untimed ones (every rank steps together: each step
   all-sums the attention and MLP outputs): median and mean latency and tokens/s (1 / mean).

Rank 0 gathers every rank's rows and writes one JSON document to ``--out``: the settings, the model shape, the
weights' memory per rank and, per rank and method, tokens/s, latency, KV bytes (``kv_bytes``) and measured memory
(``active_memory_growth``, ``peak_memory_growth``). Without ``mlx.launch`` it runs on one process (group size 1).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
DEFAULT_METHODS = "kvcache,affine:4,turboquant:4,turboquant:3"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama3-8b", help="kvq.bench.random_model preset (default llama3-8b)")
    p.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default: all)")
    p.add_argument("--context", default="65536", help="context length(s) in tokens, comma-separated (default 65536)")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"method strings (default {DEFAULT_METHODS})")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps (default 32)")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps first (default 2)")
    p.add_argument("--chunk", type=int, default=4096, help="tokens per update_and_fetch when filling (default 4096)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="weights and KV dtype (default: float16 on a GPU, float32 on a CPU)")
    p.add_argument("--sinks", type=int, default=4, help="kvq caches' uncompressed first tokens (default 4)")
    p.add_argument("--window", type=int, default=128, help="kvq caches' uncompressed last tokens (default 128)")
    p.add_argument("--kernels", choices=("auto", "require", "off"), default="auto", help="kvq kernel preference")
    p.add_argument("--out", required=True, help="JSON result path (written by rank 0)")
    return p


def parse_contexts(text: str) -> tuple[int, ...]:
    """``"4096,65536"`` -> ``(4096, 65536)``. :raises ValueError: not positive integers."""
    try:
        contexts = tuple(int(part) for part in text.split(","))
    except ValueError:
        contexts = ()
    if not contexts or min(contexts) < 1:
        raise ValueError(f"--context must be positive integers separated by commas; got {text!r}")
    return contexts


def build_sharded_model(config: dict, dtype: mx.Dtype, group: mx.distributed.Group, seed: int = 0):
    """The random llama of ``config`` in ``dtype``, sharded over ``group`` before its weights are evaluated.

    :raises ValueError: a group size that does not divide the KV heads (:func:`kvq.distributed.check_tensor_parallel`).
    """
    from kvq.distributed import check_tensor_parallel
    from mlx_lm.models import llama

    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))  # lazy: nothing is computed yet
    model.set_dtype(dtype)
    if group.size() > 1:
        check_tensor_parallel(config["num_key_value_heads"], config["num_attention_heads"], group.size())
        model.shard(group)
    for module in [model.model.embed_tokens, *model.layers, model.model.norm, getattr(model, "lm_head", None)]:
        if module is not None:  # one module at a time: only this rank's slices are ever resident
            mx.eval(module.parameters())
    return model


def gather_json(document, group: mx.distributed.Group) -> list:
    """Every rank's JSON-serialisable ``document``, in rank order (all ranks get the list)."""
    data = np.frombuffer(json.dumps(document).encode(), dtype=np.uint8).astype(np.int32)  # int32: every back end
    sizes = mx.distributed.all_gather(mx.array([data.size], dtype=mx.int32), group=group)
    size = int(mx.max(sizes).item())
    padded = np.zeros(size, dtype=np.int32)
    padded[: data.size] = data
    gathered = np.array(mx.distributed.all_gather(mx.array(padded), group=group)).reshape(group.size(), size)
    return [json.loads(row[: int(n)].astype(np.uint8).tobytes().decode()) for row, n in zip(gathered, np.array(sizes))]


def run(args: argparse.Namespace, group: mx.distributed.Group) -> dict:
    """Measure every method on this rank; returns this rank's part of the result."""
    from kvq.bench.e2e import E2EBench, E2ESettings, parse_methods
    from kvq.bench.random_model import random_config

    config = random_config(args.preset, args.layers)
    head_dim = config["head_dim"]
    dtype = DTYPES[args.dtype] if args.dtype else (mx.float32 if mx.default_device() == mx.cpu else mx.float16)
    specs = parse_methods(args.methods, head_dim, args.sinks, args.window)
    tic = time.perf_counter()
    model = build_sharded_model(config, dtype, group)
    weights = {"build_seconds": time.perf_counter() - tic, "active_memory": mx.get_active_memory()}
    settings = E2ESettings(parse_contexts(args.context), steps=args.steps, warmup=args.warmup, chunk=args.chunk,
                           sinks=args.sinks, window=args.window, kernels=args.kernels, progress=group.rank() == 0)
    bench = E2EBench(model, settings)
    bench.kv_heads = config["num_key_value_heads"] // group.size()  # this rank's KV heads (the caches' H)
    rows = bench.run(specs)
    return {"rank": group.rank(), "kv_heads": bench.kv_heads, "dtype": str(dtype).removeprefix("mlx.core."),
            "weights": weights, "rows": rows, "config": config}


def summary(ranks: list[dict]) -> list[dict]:
    """One line per (context, method): rank 0's tokens/s and every rank's KV bytes and measured memory."""
    lines = []
    for i, row in enumerate(ranks[0]["rows"]):
        per_rank = [r["rows"][i] for r in ranks]
        lines.append({"context": row["context"], "method": row["method"], "error": row["error"],
                      "tokens_per_second": row.get("tokens_per_second"),
                      "kv_bytes_per_rank": [r.get("kv_bytes") for r in per_rank],
                      "active_memory_growth_per_rank": [r.get("active_memory_growth") for r in per_rank],
                      "kv_bytes_ratio": row.get("kv_bytes_ratio"), "speed_vs_fp16": row.get("speed_vs_fp16")})
    return lines


def main(argv: list[str] | None = None) -> int:
    import mlx_lm

    import kvq

    args = build_parser().parse_args(argv)
    parse_contexts(args.context)  # bad input fails before the model is built
    group = mx.distributed.init()
    mine = run(args, group)
    ranks = gather_json(mine, group) if group.size() > 1 else [mine]
    if group.rank() == 0:
        config = ranks[0]["config"]
        document = {
            "benchmark": "distributed_decode", "command": " ".join(sys.argv), "group_size": group.size(),
            "device": str(mx.default_device()), "device_info": _device_info(), "host": platform.node(),
            "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "kvq": kvq.__version__},
            "model": {"preset": args.preset, "config": config, "dtype": ranks[0]["dtype"],
                      "kv_heads_per_rank": ranks[0]["kv_heads"]},
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "summary": summary(ranks),
            "ranks": [{k: v for k, v in r.items() if k != "config"} for r in ranks],
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(document, indent=2))
        for line in document["summary"]:
            print(json.dumps(line), flush=True)
    return 0


def _device_info() -> dict:
    try:
        return {k: v for k, v in mx.device_info().items() if isinstance(v, (int, float, str))}
    except (AttributeError, RuntimeError):
        return {}


if __name__ == "__main__":
    sys.exit(main())
