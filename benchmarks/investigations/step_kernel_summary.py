"""A summary of ``decode_step_kernels.py``'s JSON: per method, the median step that did not flush (GPU us in all,
launches) and its kernels grouped by kind (the name up to its template arguments), largest first; with
``--layers-of`` a model's layer count, what the step would cost in that model: the kinds that run once a step (one
launch where the profile kept two or more layers: the embedding, the lm_head, the argmax) once, the rest per layer
(their sum over the profiled layers, scaled).

    python benchmarks/investigations/step_kernel_summary.py steps.json [--layers-of 32]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict


def kind(name: str) -> str:
    """A kernel's kind: its name without template arguments or parameters, custom kernels by their source name."""
    name = re.sub(r"^void ", "", name)
    custom = re.match(r"mlx::custom_kernel_(kvq_[a-z_]+?)(_[0-9a-f]{6,})", name)
    if custom:
        return custom.group(1)
    return re.split(r"[<(]", name, maxsplit=1)[0]


def summarise(result: dict) -> dict:
    """``{"us": median normal step, "launches": n, "kinds": {kind: [us, count]}}`` of one method's steps."""
    normal = sorted((s for s in result["steps"] if not s["flushed"]), key=lambda s: s["us"])
    if not normal:
        return {}
    step = normal[len(normal) // 2]
    kinds = defaultdict(lambda: [0.0, 0])
    for name, us in step["kernels"]:
        kinds[kind(name)][0] += us
        kinds[kind(name)][1] += 1
    flushes = [s["us"] for s in result["steps"] if s["flushed"]]
    return {"us": step["us"], "launches": len(step["kernels"]), "flush_steps_us": flushes,
            "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1][0]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--layers-of", type=int, default=None, help="a model's layer count: the step scaled to it")
    args = ap.parse_args()
    data = json.load(open(args.json))
    print(f"context {data['context']}, {data['layers']} layers, batch {data.get('batch', 1)}")
    for result in data["results"]:
        s = summarise(result)
        if not s:
            continue
        print(f"\n{result['method']}: normal step {s['us']:.1f} us, {s['launches']} launches; flush steps "
              f"{[round(x) for x in s['flush_steps_us']]}")
        for name, (us, n) in list(s["kinds"].items())[: args.top]:
            print(f"  {us:9.1f} us  {n:3d}x  {name[:90]}")
        if args.layers_of and data["layers"] > 1:
            once = sum(us for us, n in s["kinds"].values() if n == 1)
            per_layer = (s["us"] - once) / data["layers"]
            print(f"  per layer {per_layer:.1f} us, once a step {once:.1f} us: {args.layers_of} layers "
                  f"{(per_layer * args.layers_of + once) / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
