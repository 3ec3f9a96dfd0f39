"""Write ``docs/results.md`` from the committed result JSON under ``benchmarks/results``.

    uv run python benchmarks/report.py            # rewrites docs/results.md
    uv run python benchmarks/report.py --out F    # writes F instead (tests/test_results_doc.py compares the two)

Each benchmark gets one table: its latest run. Runs are grouped by what they measured (the benchmark, the device,
the model and, for decode, the batch); within a group newer runs replace every older run whose caches and contexts
they cover, so a new result file replaces its table instead of adding prose. Files of one run differ only in a ``-repN`` or
``-runN`` suffix and are shown side by side. Runs under a ``knob-sweeps`` folder (made with launch knobs other than
the library's, ``benchmarks/knobs.py``) are left out. Reads JSON only: no model, no MLX.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "results.md"
MIB = 2**20
REP = re.compile(r"-(rep|run)\d+$")
#: A folder of runs made with launch knobs other than the library's (``benchmarks/knobs.py``): never a table here.
SWEEPS = "knob-sweeps"
#: Prefill chunk of the main tables (mlx-lm's ``prefill_step_size`` default); runs with other chunks get their own.
PREFILL_STEP = 2048


def load(path: Path) -> dict | None:
    """A result file as a run record (kind, group key, date, methods, documents), or None for other JSON."""
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict):
        return None
    day = path.name[:10]
    kind = str(doc.get("benchmark", "")).removeprefix("kvq bench ")
    if kind in ("e2e", "prefill", "batch", "capacity"):
        env, s = doc["environment"], doc["settings"]
        model = f"{doc['model']['name']} ({doc['model']['dtype']})"
        chunk = s.get("chunk", PREFILL_STEP) if kind == "prefill" else PREFILL_STEP
        shape = (s.get("batch", 1) if kind == "e2e" else
                 (tuple(s["batches"]), s["prompt"]) if kind == "batch" else
                 chunk if chunk != PREFILL_STEP else None)  # runs of other shapes: own tables
        key = (kind, env["device"], model, shape)
        title = model + (f", {s['batch']} sequences at once" if s.get("batch", 1) > 1 else "")
        if chunk != PREFILL_STEP:
            title += f", chunks of {chunk:,} tokens"
        if kind == "batch":
            title += f", prompts of {s['prompt']:,} tokens"
        if kind == "capacity" and s.get("context"):
            title += f", sequences of {s['context']:,} tokens"
        device = f"CPU ({env['device']})" if env["device_kind"] == "cpu" else env["device"]
        contexts = s.get("contexts") or [s.get("context")]
        return dict(kind=kind, key=key, title=title, date=env["date"], command=env["command"], device=device,
                    mlx=env["mlx"], methods=renamed(s["methods"]), contexts=set(contexts), docs=[doc], paths=[path])
    if "meta" in doc and str(doc["meta"].get("command", "")).startswith("kvq eval"):
        m, s = doc["meta"], doc["runs"][0]["settings"]
        methods = renamed(r["method"] for run in doc["runs"] for r in run["rows"])
        key = ("eval", m["model"], s["context"], s["windows"])
        title = f"{m['model']}, {s['context']:,} tokens, {s['windows']} window{'s' * (s['windows'] > 1)}"
        return dict(kind="eval", key=key, title=title, date=m["date"], command=m["command"], device=m["versions"]["mlx_device"],
                    mlx=m["versions"]["mlx"], methods=methods, docs=[doc], paths=[path])
    command = str(doc.get("command", ""))
    if doc.get("benchmark") == "serve load":
        env, f = doc["environment"], doc["figures"]
        device = env["device"]
        return dict(kind="serve", key=("serve", device, f["clients"], f["requests"]),
                    title=f"{f['clients']} clients, {f['runs']} runs of {f['requests']} requests", date=env["date"],
                    command=doc["command"], device=device, mlx=env["mlx"], methods=set(), docs=[doc], paths=[path])
    if doc.get("benchmark") == "distributed_decode":
        device = f"{doc['group_size']} x {doc['device_info']['device_name']}"
        return dict(kind="distributed", key=("distributed", device, doc["settings"]["context"]),
                    title=f"tensor parallel, {doc['model']['preset']} shape, {doc['settings']['context']} tokens",
                    date=day, command=command, device=device, mlx=doc["versions"]["mlx"],
                    methods=renamed(doc["settings"]["methods"].split(",")), docs=[doc], paths=[path])
    if command.startswith("benchmarks/kernel_durations.py") and not re.search(r"--(?!out)\w", command):
        device = "NVIDIA H200" if "-h200-" in path.name else path.name.split("-")[3]
        methods = {r["method"] for r in doc["rows"]}
        return dict(kind="kernels", key=("kernels", device), title="one sequence", date=day, command=command, device=device, mlx="-",
                    methods=methods, docs=[doc], paths=[path])
    return None


def renamed(methods) -> set[str]:
    """The method strings of a run, the reference by its name since 2026-12-05 (``fp16`` before): a newer run with
    ``kvcache`` replaces an older one with ``fp16`` (in kvq eval files that was kvq's 16-bit cache: the newer run
    measures against mlx-lm's KVCache instead, and the older stays in git history)."""
    return {"kvcache" if m == "fp16" else m for m in methods}


def runs(results: Path = RESULTS) -> list[dict]:
    """Every run in ``results``, the files of one run (``-repN``) merged, newest first."""
    merged: dict[tuple, dict] = {}
    for path in sorted(results.rglob("*.json")):
        if SWEEPS in path.parts:
            continue
        run = load(path)
        if run is None:
            continue
        stem = (path.parent, REP.sub("", path.stem), run["key"])
        if stem in merged:
            merged[stem]["docs"] += run["docs"]
            merged[stem]["paths"] += run["paths"]
            merged[stem]["methods"] |= run["methods"]
            if "contexts" in run:
                merged[stem]["contexts"] = merged[stem].get("contexts", set()) | run["contexts"]
            merged[stem]["date"] = max(merged[stem]["date"], run["date"])
        else:
            merged[stem] = run
    return sorted(merged.values(), key=lambda r: (r["date"], str(r["paths"][0])), reverse=True)


def measured(run: dict) -> set[tuple]:
    """A run's (cache, context) pairs (every context ``None`` where a benchmark's group key holds the context)."""
    return {(m, c) for m in run["methods"] for c in run.get("contexts", {None})}


def latest(all_runs: list[dict]) -> list[dict]:
    """The runs that newer runs of the same group do not cover: a run is left out where the newer runs kept hold
    every (cache, context) pair it measured; otherwise it is shown whole (a 32K run leaves an older run of 32K and
    128K shown, its 32K rows included)."""
    kept: list[dict] = []
    for run in all_runs:  # newest first
        newer = [measured(k) for k in kept if k["key"] == run["key"]]
        if not newer or not measured(run) <= set().union(*newer):
            kept.append(run)
    return kept


def cache_name(r: dict, dtype: str) -> str:
    """A row's cache as every table names it: the reference, mlx-lm's caches in the model's dtype, as ``kvcache
    (dtype)`` (files before 2026-12-05 wrote ``fp16`` for it in kvq bench); kvq's 16-bit cache as ``kvq-fp16`` (the
    reference of kvq eval files before then wrote ``fp16`` for it); other mlx-lm caches with their class."""
    cache = r.get("cache") or ("mlx-lm KVCache" if r["method"] in ("kvcache", "fp16") else "kvq")  # capacity rows
    if r["method"] in ("kvcache", "fp16") and cache == "mlx-lm KVCache":
        return f"kvcache ({dtype.removeprefix('mlx.core.')})"
    if r["method"] == "fp16":
        return "kvq-fp16"
    return r["method"] + ("" if cache.startswith("kvq") else f" ({cache})")


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def ratio(text: str, value: float | None) -> str:
    return text if value is None or abs(value - 1) < 1e-9 else f"{text} ({value:.2f})"


def reps(run: dict) -> list[str]:
    return [f"rep {i + 1}" for i in range(len(run["docs"]))] if len(run["docs"]) > 1 else [""]


def failed(row: dict, cells: int) -> list[str]:
    """The ``cells`` cells of a row that failed: its error (shortened), then dashes."""
    return ["error: " + row["error"][:80]] + ["-"] * (cells - 1)


def e2e(run: dict) -> str:
    first, dtype = run["docs"][0]["rows"], run["docs"][0]["model"]["dtype"]
    heads = ["context", "cache", "bits/coord", "KV MiB measured (x kvcache)"]
    heads += [f"ms/token mean, tokens/s (x kvcache) {r}".strip() for r in reps(run)]
    rows = []
    for i, r in enumerate(first):
        cells = [f"{r['context']:,}", cache_name(r, dtype),
                 f"{r['bits_per_coordinate']:.3g}"]
        if r["error"]:
            rows.append(cells + failed(r, 1 + len(run["docs"])))
            continue
        cells.append(ratio(f"{r['active_memory_growth'] / MIB:,.1f}", r["memory_ratio"]))
        for doc in run["docs"]:
            o = doc["rows"][i]
            cells.append(ratio(f"{o['latency_ms']['mean']:.3g}, {o['tokens_per_second']:,.1f}", o["speed_vs_fp16"]))
        rows.append(cells)
    return table(heads, rows)


def prefill(run: dict) -> str:
    doc = run["docs"][-1]
    last = max(r["rep"] for r in doc["rows"])
    heads = ["context", "cache", *[f"tokens/s rep {n + 1} (x kvcache)" for n in range(last + 1)],
             f"peak MiB above the model, rep {last + 1} (x kvcache)"]
    rows = []
    for r in (r for r in doc["rows"] if r["rep"] == last):
        same = [o for o in doc["rows"] if o["context"] == r["context"] and o["method"] == r["method"]]
        speeds = [ratio(f"{o['tokens_per_second']:,.0f}", o["speed_vs_fp16"]) for o in same]
        rows.append([f"{r['context']:,}", cache_name(r, doc["model"]["dtype"]), *speeds,
                     ratio(f"{r['peak_memory_growth'] / MIB:,.0f}", r["peak_vs_fp16"])])
    return table(heads, rows)


def batch(run: dict) -> str:
    heads = ["sequences", "cache", "rep", "decode tokens/s, all sequences (x kvcache)",
             "bandwidth ceiling x kvcache", "prefill speed x kvcache", "peak MiB above the model (x kvcache)"]
    rows = [[str(r["batch"]), cache_name(r, doc["model"]["dtype"]), str(r["rep"] + 1),
             *(failed(r, 4) if r["error"] else
               [ratio(f"{r['decode_tokens_per_second']:,.1f}", r["decode_vs_fp16"]),
                # (weights + kvcache's cache bytes) / (weights + this row's); files before 2026-12-07 lack it
                "-" if r.get("ceiling_vs_fp16") is None else f"{r['ceiling_vs_fp16']:.2f}",
                "-" if r["prefill_vs_fp16"] is None else f"{r['prefill_vs_fp16']:.2f}",
                ratio(f"{r['peak_memory_growth'] / MIB:,.0f}", r["peak_vs_fp16"])])]
            for doc in run["docs"] for r in doc["rows"]]
    return table(heads, rows)


def capacity(run: dict) -> str:
    heads = ["cache", "sequences that fit (x kvcache)", "cache MiB per sequence",
             "decode tokens/s, all sequences (x kvcache)", "ms/step"]
    rows = [[cache_name(r, doc["model"]["dtype"]),
             *(failed(r, 4) if r["error"] else
               [ratio(str(r["max_batch"]), r["batch_vs_fp16"]), f"{r['kv_bytes'] / r['max_batch'] / MIB:,.0f}",
                ratio(f"{r['tokens_per_second']:,.0f}", r["tokens_vs_fp16"]),
                f"{r['row']['latency_ms']['mean']:.1f}"])]
            for doc in run["docs"] for r in doc["rows"]]
    return table(heads, rows)


def quality(run: dict) -> str:
    dtype = run["docs"][0]["meta"]["model_dtype"]
    reference = cache_name(run["docs"][0]["runs"][0]["rows"][0], dtype).split(" (")[0]  # kvq-fp16 before 2026-12-05
    heads = ["cache", "bits/coord", "PPL change", f"KL({reference} ‖ cache)", "top-1", "needles",
             f"KV MiB (x {reference})"]
    rows = []
    for r in (r for doc in run["docs"] for one in doc["runs"] for r in one["rows"]):
        trials = r["needle"]["trials"]
        key, value = r["key_bits_per_coordinate"], r["value_bits_per_coordinate"]
        bits = f"{key:.3g}" if key == value else f"{key:.3g} / {value:.3g}"
        rows.append([cache_name(r, dtype), bits,
                     f"{100 * r['ppl_change']:+.1f}%", f"{r['kl']:.3f}", f"{100 * r['top1_agreement']:.1f}%",
                     f"{sum(t['match'] for t in trials)}/{len(trials)}" if trials else "-",
                     ratio(f"{r['kv_bytes'] / MIB:.1f}", r["kv_bytes_ratio"])])
    return table(heads, rows)


def kernels(run: dict) -> str:
    rows = run["docs"][0]["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "fp16_sdpa"))
    heads = ["tokens", "fp16 SDPA", *methods]

    def us(t: int, method: str, **flags) -> str:
        hit = [r for r in rows if r["T"] == t and r["method"] == method
               and all(r.get(k, False) == v for k, v in flags.items())]
        return f"{hit[0]['gpu_us']:.1f}" if hit else "-"

    out = [[f"{t:,}", us(t, "fp16_sdpa"),
            *[" / ".join(us(t, m, dense=d, bound=b) for d, b in ((False, False), (True, False), (False, True)))
              for m in methods]] for t in sorted({r["T"] for r in rows})]
    return table(heads, out)


def distributed(run: dict) -> str:
    heads = ["cache", "KV MiB per rank (x kvcache)", *[f"tokens/s {r}".strip() for r in reps(run)]]
    first, dtype = run["docs"][0]["summary"], run["docs"][0]["model"]["dtype"]
    rows = [[cache_name(r, dtype), ratio(f"{max(r['active_memory_growth_per_rank']) / MIB:,.0f}", r["kv_bytes_ratio"]),
             *[f"{doc['summary'][i]['tokens_per_second']:.1f}" for doc in run["docs"]]]
            for i, r in enumerate(first) if not r["error"]]
    return table(heads, rows)


def serve(run: dict) -> str:
    doc = run["docs"][0]
    f = doc["figures"]
    mib = ", ".join(f"{m / MIB:.1f}" for m in f["active_memory"])
    rows = [["clients; requests per run; runs", f"{f['clients']}; {f['requests']}; {f['runs']}"],
            ["seconds per run", ", ".join(f"{s:.1f}" for s in f["seconds"])],
            ["answered 200; refused 4xx; 5xx", f"{f['status_200']}; {f['status_4xx']}; {f['status_5xx']}"],
            ["clients gone mid-stream; tracebacks in the log", f"{f['clients_gone']}; {f['tracebacks']}"],
            ["distinct answers to the identical chat (all runs)", str(f["identical_answers"])],
            ["active MiB after clearing the prompt cache: before, after each run", mib],
            ["checks", ", ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in doc["checks"].items())]]
    return table(["figure", "value"], rows)


SECTIONS = {  # kind: (title, renderer, what the table shows)
    "eval": ("Quality (`kvq eval`)", quality,
             "Perplexity change, KL divergence and top-1 agreement against the run's reference on the same tokens "
             "(its name in the header: kvcache, mlx-lm's KVCache in the model's dtype, since 2026-12-05; kvq-fp16, "
             "kvq's 16-bit cache, in runs before then), "
             "every token scored as token-by-token decoding sees it; KV MiB at the context's end. Runs dated "
             "before 2026-12-01 scored their tokens in one forward pass that read compressed copies of their own "
             "recent neighbours (pessimistic for kvq)."),
    "e2e": ("Decode (`kvq bench e2e`)", e2e,
            "One decode step after a filled context; tokens/s = sequences / mean step (window flushes included); "
            "KV measured = growth of `mx.get_active_memory()`; kvcache = mlx-lm's KVCache in the model's dtype."),
    "prefill": ("Prefill (`kvq bench prefill`)", prefill,
                "The prompt prefilled in chunks as `mlx_lm.generate` does; the first repetition includes compiling."),
    "batch": ("Concurrent sequences (`kvq bench batch`, mlx-lm's BatchGenerator)", batch,
              "Aggregate decode tokens/s of every sequence, as a server under concurrent load gives. Bandwidth "
              "ceiling = (weights + kvcache's cache bytes) / (weights + this cache's), the bytes allocated after the "
              "middle decode step: the most a step bound by memory bandwidth could gain over kvcache."),
    "capacity": ("Capacity (`kvq bench capacity`)", capacity,
                 "The largest batch of equal-length sequences whose measured peak fits the device's memory."),
    "kernels": ("Fused decode-attention kernels (`benchmarks/kernel_durations.py`)", kernels,
                "GPU microseconds per call (Nsight Compute), B 1, H_q 32, H_kv 8, D 128, one query: compressed "
                "tokens only / with 4 sinks and a 128-token window in the same launch / the bound decode step a "
                "`KVQCache` replays."),
    "distributed": ("Across GPUs (`mlx.launch --backend nccl`, `benchmarks/distributed_decode.py`)", distributed,
                    "Each rank holds half the KV heads; tokens/s over few timed steps are noisy."),
    "serve": ("`kvq serve` under load (`benchmarks/serve_load.py`, `tests/test_serve_hardened.py`)", serve,
              "Concurrent clients on 127.0.0.1 against `kvq serve` (turboquant 4-bit caches) on a tiny random "
              "llama with a 128-token context: identical chats plain and streamed, different completions, clients "
              "that leave mid-stream, malformed and over-long requests (each refused in OpenAI's error shape), the "
              "whole load three times. Memory: the server's `mx.get_active_memory()` after clearing its prompt "
              "cache (`GET /kvq/memory`). The test runs the 16-client size; the larger one is this script's default."),
}


def section(run: dict) -> str:
    files = ", ".join(f"[{p.name}](../{p.relative_to(ROOT).as_posix()})" for p in run["paths"])
    device = "CPU" if run["device"] == "Device(cpu, 0)" else run["device"]
    return "\n".join([f"### {run['title']} on {device}", "",
                      f"{run['date'][:10]} · MLX {run['mlx']} · `{run['command']}` · {files}", "",
                      SECTIONS[run["kind"]][1](run), ""])


def document(results: Path = RESULTS) -> str:
    kept = latest(runs(results))
    parts = ["# Results", "",
             "Written by `uv run python benchmarks/report.py` from the JSON under `benchmarks/results` (do not edit "
             "by hand): the latest run of each benchmark, on each device and model. Ratios in parentheses are against "
             "the reference of the same run: kvcache, mlx-lm's `KVCache` in the model's dtype (result files "
             "before 2026-12-05 call it fp16), except in quality tables of runs before 2026-12-05, whose reference "
             "was kvq-fp16 (kvq's 16-bit cache), as their headers say. Older runs are in git history.", ""]
    for kind, (title, _, what) in SECTIONS.items():
        mine = [r for r in kept if r["kind"] == kind]
        if mine:
            parts += [f"## {title}", "", what, ""] + [section(r) for r in mine]
    return "\n".join(parts).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="where to write (default docs/results.md)")
    args = parser.parse_args()
    args.out.write_text(document())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
