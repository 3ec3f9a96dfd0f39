"""docs/results.md is what ``benchmarks/report.py`` writes from the committed result JSON (no model, no MLX)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_results_doc_is_regenerated_from_the_committed_json(tmp_path):
    out = tmp_path / "results.md"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--out", str(out)], check=True,
                   timeout=120)
    committed = (ROOT / "docs" / "results.md").read_text()
    assert out.read_text() == committed, "docs/results.md is stale: run `uv run python benchmarks/report.py`"


def test_every_file_the_docs_link_exists():
    """Every relative markdown link of the README and docs/ names a file of this repository."""
    import re

    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name} links {target}, which does not exist"


def test_every_table_names_the_reference_as_the_commands_now_do():
    """Issue #54: result files before 2026-12-05 wrote ``fp16`` for mlx-lm's KVCache (kvq bench) and for kvq's
    16-bit cache (the reference of kvq eval); the tables name the first ``kvcache (dtype)``, as every command now
    does, and the second ``kvq-fp16``, without rewriting the files."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report

    name = report.cache_name
    assert name({"method": "fp16", "cache": "mlx-lm KVCache"}, "bfloat16") == "kvcache (bfloat16)"
    assert name({"method": "kvcache", "cache": "mlx-lm KVCache"}, "mlx.core.float32") == "kvcache (float32)"
    assert name({"method": "fp16"}, "bfloat16") == "kvcache (bfloat16)"  # capacity rows name no cache
    assert name({"method": "fp16", "cache": "kvq KVQCache"}, "mlx.core.float32") == "kvq-fp16"
    assert name({"method": "mlx-affine:4", "cache": "mlx-lm QuantizedKVCache"}, "bfloat16") == (
        "mlx-affine:4 (mlx-lm QuantizedKVCache)")
    assert name({"method": "turboquant:3"}, "bfloat16") == "turboquant:3"
    text = (ROOT / "docs" / "results.md").read_text()
    assert "| fp16 |" not in text and "x fp16" not in text  # ("fp16 SDPA": mx.fast attention on 16-bit data)


def test_a_newer_run_hides_an_older_one_only_where_it_measured_the_same_caches_and_contexts():
    """A 32K run of three caches does not hide an older run's 128K rows of them (it did until 2026-12-07); the
    32K and 128K runs after it together do; a run of no caches (serve load) is hidden by a newer one of its group
    only."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report

    def run(name, methods, contexts=None, key="e2e"):
        out = {"name": name, "key": key, "methods": set(methods)}
        if contexts is not None:
            out["contexts"] = set(contexts)
        return out

    old = run("old", {"kvcache", "qjl"}, {32768, 131072})
    short = run("32K", {"kvcache", "qjl"}, {32768})
    long = run("128K", {"kvcache", "qjl", "turboquant_prod"}, {131072})
    names = lambda runs: [r["name"] for r in report.latest(runs)]  # noqa: E731  (newest first, as runs() orders)
    assert names([short, old]) == ["32K", "old"]
    assert names([long, short, old]) == ["128K", "32K"]
    assert names([run("serve new", set(), key="serve"), run("serve old", set(), key="serve"),
                  run("other", set(), key="other")]) == ["serve new", "other"]
