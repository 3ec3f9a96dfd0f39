"""Decode memory above the caches, step by step, for a kvq cache at a large batch (issue #52's capacity bars).

    python decode_peaks.py OUT.json [--method turboquant:3] [--batch 48] [--context 32K] [--steps 300]
        [--variants current,views-held,at-flush]

A random-weight Llama-3-8B shape (bfloat16), every layer's cache filled with random keys and values, then greedy
decode pipelined as mlx-lm's generate runs it (:func:`kvq.bench.fill.decode`'s loop). For every step: the peak of
``mx.get_peak_memory()`` above the memory held before it (reset each step; with the pipeline the peak of step ``i``
includes what step ``i + 1``'s queueing allocated), and whether this layer's caches flushed or grew then. Variants
switch one of this session's changes back off, in this process, to measure what each bought:
``views-held`` (the bound decode step and the store's view kept across the flush's writes, which MLX then makes a
copy of the whole field), ``at-flush`` (every layer's store grown in the flush step), ``current`` (neither), and
one that tries a change: ``sync-flush`` (``mx.synchronize()`` before a flush's writes, so that no kernel of the step
in flight holds the stores and MLX writes in place).
"""
import argparse
import json
import time

import mlx.core as mx


def _size(text: str) -> int:
    text = text.strip().upper()
    return int(float(text[:-1]) * 1024) if text.endswith("K") else int(text)


def run(variant: str, args, model, config: dict) -> dict:
    from kvq.bench.e2e import E2ESettings, make_cache
    from kvq.bench.fill import RandomKV, fill
    from kvq.bench.e2e import parse_methods
    from kvq.cache import KVQCache
    from kvq.cache import store as store_module

    saved = {}
    if variant == "at-flush":
        saved["schedule"] = KVQCache._schedule_growth
        KVQCache._schedule_growth = lambda self: None
    if variant == "views-held":  # as before: the bound step survives the flush, the view is cleared after the write
        saved["compress"] = KVQCache._compress

        def compress(self, *args):
            bound = self._bound
            saved["compress"](self, *args)
            self._bound = bound
        KVQCache._compress = compress
        saved["append"] = store_module.EncodedStore.append

        def append(self, encoded, *args, **kwargs):
            view = self._view
            saved["append"](self, encoded, *args, **kwargs)
            del view
        store_module.EncodedStore.append = append
    if variant == "sync-flush":  # wait for the step in flight before a decode flush's writes (then in place)
        saved["compress_sync"] = KVQCache._compress

        def compress_sync(self, *args):
            mx.synchronize()
            saved["compress_sync"](self, *args)
        KVQCache._compress = compress_sync
    try:
        heads, head_dim = config["num_key_value_heads"], config["head_dim"]
        spec = [s for s in parse_methods(args.method, head_dim) if s.label == args.method][0]
        settings = E2ESettings(contexts=(args.context,), batch=args.batch)
        caches = make_cache(model, spec, settings)
        fill(caches, RandomKV(heads, head_dim, mx.bfloat16, batch=args.batch), args.context, 4096)
        kv = sum(c.nbytes for c in caches)
        mx.eval([c.state for c in caches])

        def step(y):
            return mx.argmax(model(y, cache=caches)[:, -1:, :], axis=-1)

        nxt = step(mx.full((args.batch, 1), 1, dtype=mx.int32))
        mx.async_eval(nxt)
        rows = []
        for i in range(args.steps):
            before = mx.get_active_memory()
            mx.reset_peak_memory()
            state = [(c.compressed_keys.length, c.compressed_keys.capacity) for c in caches]
            tic = time.perf_counter()
            y, nxt = nxt, None
            nxt = step(y)
            mx.async_eval(nxt)
            y.tolist()
            seconds = time.perf_counter() - tic
            after = [(c.compressed_keys.length, c.compressed_keys.capacity) for c in caches]
            rows.append({"step": i, "peak_above_before": mx.get_peak_memory() - before, "ms": seconds * 1e3,
                         "flushed": sum(a[0] != b[0] for a, b in zip(after, state)),
                         "grew": sum(a[1] != b[1] for a, b in zip(after, state))})
        mx.eval(nxt)
        del caches, nxt
        return {"variant": variant, "kv_bytes": kv, "steps": rows}
    finally:
        if "schedule" in saved:
            KVQCache._schedule_growth = saved["schedule"]
        if "compress_sync" in saved:
            KVQCache._compress = saved["compress_sync"]
        if "compress" in saved:
            KVQCache._compress = saved["compress"]
            store_module.EncodedStore.append = saved["append"]
        mx.clear_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--method", default="turboquant:3")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--context", type=_size, default=32768)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--variants", default="current,sync-flush,at-flush")
    ap.add_argument("--model", default="random:llama3-8b")
    args = ap.parse_args()
    from kvq.bench.random_model import build_random_model, random_config

    config = random_config(args.model)
    model = build_random_model(config, mx.bfloat16)
    results = []
    for variant in args.variants.split(","):
        result = run(variant, args, model, config)
        results.append(result)
        steps = result["steps"]
        gb = lambda b: b / 1e9  # noqa: E731
        kinds = {"flush+grow": [s for s in steps if s["flushed"] and s["grew"]],
                 "flush": [s for s in steps if s["flushed"] and not s["grew"]],
                 "grow": [s for s in steps if s["grew"] and not s["flushed"]],
                 "other": [s for s in steps if not s["flushed"] and not s["grew"]]}
        print(variant, "kv GB %.3f" % gb(result["kv_bytes"]), "; ".join(
            f"{k} x{len(v)}: peak above GB max {gb(max(s['peak_above_before'] for s in v)):.3f}, ms max "
            f"{max(s['ms'] for s in v):.1f}" for k, v in kinds.items() if v), flush=True)
        with open(args.out, "w") as f:
            json.dump({"mlx": mx.__version__, "device": str(mx.default_device()), "args": vars(args),
                       "results": results}, f)


if __name__ == "__main__":
    main()
