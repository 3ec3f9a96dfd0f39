"""cProfile of the host's share of a prefill (issue #51): one model, one method, a warm prefill profiled.

    python benchmarks/investigations/prefill_host_profile.py OUT_DIR [--model random:llama3-8b] [--layers 8]
        [--context 8192] [--chunk 2048] [--method turboquant:3] [--dtype bfloat16]

Prefills three times (the first compiles kernels) and profiles the third with cProfile, which writes
OUT_DIR/profile-<method>.txt (top functions by own and cumulative time); cProfile's own cost per Python call roughly
doubles the host's time, so the second repetition is timed instead with a few wrapped calls (``time.perf_counter``
around the cache's update and attention, the layer queue's push and the guard's first-block decision: ms per
layer and chunk, in OUT_DIR/split-<method>.json and printed).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import mlx.core as mx


class _Timers:
    """``time.perf_counter`` around a few calls of the prefill (their seconds summed by name), undone by :meth:`undo`."""

    def __init__(self) -> None:
        from mlx_lm.models.cache import KVCache

        from kvq.cache import guard, layer, prefill

        self.seconds: dict[str, float] = {}
        self._undo = []
        for owner, name, label in ((layer.KVQCache, "update_and_fetch", "kvq_update"),
                                   (layer.KVQCache, "attend", "kvq_attend"),
                                   (prefill.InFlight, "push", "queue_push"),
                                   (layer, "guard_layer", "guard"),
                                   (layer, "decide_ahead", "guard_ahead"),
                                   (layer.KVQCache, "settle", "guard_settle"),
                                   (prefill, "columns", "decode_columns"),
                                   (prefill, "shared_interval_mask", "mask"),
                                   (prefill, "interval_mask", "mask_unshared"),
                                   (KVCache, "update_and_fetch", "kvcache_update"),
                                   (mx.fast, "scaled_dot_product_attention", "sdpa")):
            real = getattr(owner, name, None)
            if real is None:
                continue
            self._undo.append((owner, name, real))
            setattr(owner, name, self._wrap(real, label))

    def _wrap(self, real, label):
        def timed(*a, **k):
            tic = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - tic
        return timed

    def undo(self) -> None:
        for owner, name, real in self._undo:
            setattr(owner, name, real)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--method", default="turboquant:3")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    from kvq.bench.e2e import make_cache
    from kvq.bench.prefill import PrefillSettings, prefill_once, prompt
    from kvq.bench.random_model import build_random_model, random_config
    from kvq.evaluation.spec import parse_method

    config = random_config(args.model, args.layers)
    model = build_random_model(config, getattr(mx, args.dtype))
    settings = PrefillSettings(contexts=(args.context,), chunk=args.chunk)
    spec = parse_method(args.method)
    ids = prompt(args.context, config["vocab_size"], None, 0)
    args.out.mkdir(parents=True, exist_ok=True)
    for rep in range(3):
        caches = make_cache(model, spec, settings)
        profiler = cProfile.Profile() if rep == 2 else None
        timers = _Timers() if rep == 1 else None
        if profiler:
            profiler.enable()
        timed = prefill_once(model, caches, ids, args.chunk)
        if profiler:
            profiler.disable()
        print(args.method, rep, {k: round(v, 4) for k, v in timed.items()}, flush=True)
        if timers:
            timers.undo()
            per = len(caches) * -(-args.context // args.chunk)
            split = {"layer_chunks": per, **timed, **{f"{k}_ms_per_layer_chunk": 1e3 * v / per
                                                      for k, v in timers.seconds.items()}}
            (args.out / f"split-{args.method.replace(':', '')}.json").write_text(json.dumps(split, indent=1))
            print("split", {k: round(v, 4) for k, v in split.items()}, flush=True)
        del caches
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(60)
    name = args.method.replace(":", "")
    (args.out / f"profile-{name}.txt").write_text(text.getvalue())
    print(text.getvalue()[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
