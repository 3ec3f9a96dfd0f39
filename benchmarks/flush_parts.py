"""What a window flush costs, by part: the host's build, the device's wait, one layer's encode and append.

Issue #21: qjl and turboquant_prod flush steps cost 44 and 98 ms against 16 for turboquant:4.

A random-weight model (``--model random:PRESET`` cut to ``--layers``), caches filled to ``--context`` random
tokens, then ``--steps`` greedy steps, each built and evaluated apart (build = ``model(...)`` + ``mx.async_eval``,
eval = waiting for it); steps in which the window flushed are reported apart. Then, on layer 0's cache, the parts
of a flush alone, each evaluated: ``encode`` (the method's quantize of ``flush`` tokens, keys and values, as the
cache's ``_encode`` selects it) and ``append`` (an :class:`kvq.cache.store.EncodedStore` holding a copy of the
layer's compressed keys appends them). ``--profile`` prints the host
functions a flush step's build spends most in (cProfile, cumulative).

    python benchmarks/flush_parts.py --out flush.json --methods fp16,qjl+affine:4,turboquant:4 --context 32768
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import mlx.core as mx


def _median_ms(xs: list[float]) -> float | None:
    return round(statistics.median(xs) * 1e3, 3) if xs else None


def run(args) -> list[dict]:
    """Per method: build and eval milliseconds of flush and other steps, and the parts of one layer's flush."""
    from kvq.bench import e2e, random_model
    from kvq.bench.fill import RandomKV, fill

    config = random_model.random_config(args.model, args.layers)
    model = random_model.build_random_model(config, mx.bfloat16)
    settings = e2e.E2ESettings(contexts=(args.context,), flush=args.flush)
    kv_heads = config["num_key_value_heads"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rows = []
    for spec in e2e.parse_methods(args.methods):
        caches = e2e.make_cache(model, spec, settings)
        fill(caches, RandomKV(kv_heads, head_dim, mx.bfloat16), args.context, 4096)
        y = mx.array([[1]])
        for _ in range(args.warmup):
            y = mx.argmax(model(y, cache=caches)[:, -1:, :], axis=-1)
            mx.eval(y)
        times = {"flush": ([], []), "other": ([], [])}
        profile = cProfile.Profile() if args.profile else None
        for _ in range(args.steps):
            store = getattr(caches[0], "compressed_keys", None)
            n0 = None if store is None else store.length
            t0 = time.perf_counter()
            will_flush = store is not None and caches[0]._leaving(caches[0].window.length, 1) > 0
            if profile is not None and will_flush:
                profile.enable()
            y = mx.argmax(model(y, cache=caches)[:, -1:, :], axis=-1)
            mx.async_eval(y)
            if profile is not None and will_flush:
                profile.disable()
            t1 = time.perf_counter()
            mx.eval(y)
            t2 = time.perf_counter()
            flushed = n0 is not None and caches[0].compressed_keys.length != n0
            build, wait = times["flush" if flushed else "other"]
            build.append(t1 - t0)
            wait.append(t2 - t1)
        row = {"method": spec.label, "context": args.context, "layers": args.layers,
               **{f"{kind}_{part}_ms": _median_ms(xs) for kind, (b, w) in times.items()
                  for part, xs in (("build", b), ("eval", w))},
               "flush_steps": len(times["flush"][0])}
        layer = caches[0]
        if hasattr(layer, "_encode"):
            k, v = RandomKV(kv_heads, head_dim, mx.bfloat16)(0, 0, layer._flush)
            mx.eval(k, v)
            enc, app = [], []
            for _ in range(args.reps):
                t = time.perf_counter()
                ek, ev = layer._encode(k, v)
                mx.eval(ek.data, ev.data)
                enc.append(time.perf_counter() - t)
            # the store's append as a flush makes it, into a store holding a copy of layer 0's keys
            from kvq.cache.store import EncodedStore

            store = EncodedStore(layer.compressed_keys.step)
            store.append(layer.compressed_keys.view())
            mx.eval(list(store.data.values()))
            for _ in range(args.reps):
                t = time.perf_counter()
                store.append(ek)
                mx.eval(list(store.data.values()))
                app.append(time.perf_counter() - t)
            del store
            row["encode_ms"] = _median_ms(enc)
            row["append_ms"] = _median_ms(app)
        if profile is not None and times["flush"][0]:
            s = io.StringIO()
            pstats.Stats(profile, stream=s).sort_stats("cumulative").print_stats(args.profile)
            row["profile"] = s.getvalue()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}))
        if "profile" in row:
            print(row["profile"][-6000:])
        del caches
        mx.clear_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--model", default="random:llama3-8b", help="random:PRESET")
    ap.add_argument("--layers", type=int, default=32, help="layers of the model kept")
    ap.add_argument("--context", type=int, default=32768, help="tokens filled")
    ap.add_argument("--methods", default="fp16,qjl+affine:4,turboquant_prod:4,turboquant:4",
                    help="kvq bench e2e method strings")
    ap.add_argument("--steps", type=int, default=97, help="decode steps measured")
    ap.add_argument("--warmup", type=int, default=8, help="steps before")
    ap.add_argument("--flush", type=int, default=32, help="the caches' flush")
    ap.add_argument("--reps", type=int, default=10, help="repetitions of the encode and append")
    ap.add_argument("--profile", type=int, default=0, help="print this many host functions of flush builds")
    args = ap.parse_args()
    rows = run(args)
    with open(args.out, "w") as f:
        json.dump({"device": str(mx.default_device()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
