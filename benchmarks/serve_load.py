"""The load and fault test of ``kvq serve`` (``tests/test_serve_hardened.py``) at a larger size, its figures as JSON.

    uv run python benchmarks/serve_load.py                          # 64 clients, 3 runs of 528 requests
    uv run python benchmarks/serve_load.py --clients 16 --copies 2  # the test's size (96 requests)

The same server (``kvq serve`` on 127.0.0.1, turboquant 4-bit caches, the tiny random llama of the test with a
128-token context, so that its over-long prompts are refused) and the same mix of requests (identical chats plain
and streamed, different completions, clients that leave mid-stream, every malformed request of the test), ``copies``
x 48 requests from ``clients`` threads, three runs; the server clears its prompt cache and reports MLX's active
memory before the first run and after each (``GET /kvq/memory``, on with ``KVQ_SERVE_MEMORY_PROBE=1``). Every check
of the test is made; the figures are written to ``benchmarks/results/serve/`` for ``benchmarks/report.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
import test_serve_hardened as load  # noqa: E402  (the test's server, requests and checks)
from distributed_worker import save_tiny_folder  # noqa: E402
from test_models import write_tiny_gguf  # noqa: E402

from kvq import __version__, models  # noqa: E402


def tiny_folder(base: Path) -> Path:
    """The test's tiny model folder (its ``tiny_folder`` fixture), under ``base``."""
    write_tiny_gguf(base / "tiny.gguf")
    os.environ["KVQ_CACHE_DIR"] = str(base / "cache")
    tokenizer_folder = models.resolve_model(base / "tiny.gguf", progress=False)
    folder = save_tiny_folder(base / "model", tokenizer_folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": load.CONTEXT}))
    return folder


def checked(figures: dict) -> dict:
    """The test's checks on ``figures``: ``{name: passed}``."""
    return {"no 5xx": figures["status_5xx"] == 0, "no traceback": figures["tracebacks"] == 0,
            "identical answers identical": figures["identical_answers"] == 1,
            "model loaded once": figures["model_loads"] == 1,
            "memory not growing from the second run to the third": load.not_growing(figures)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    parser.add_argument("--copies", type=int, default=11, help="requests per run = 48 x COPIES (default 11: 528)")
    parser.add_argument("--runs", type=int, default=3, help="runs of the load (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default benchmarks/results/serve/...)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as base:
        folder = tiny_folder(Path(base))
        started = time.monotonic()
        server = load.Server(folder)
        start_seconds = time.monotonic() - started
        try:
            figures = load.run_load(server, str(folder), args.clients, args.copies, args.runs)
        finally:
            server.stop()
    print(load.describe(figures))
    checks = checked(figures)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    date = time.strftime("%Y-%m-%d")
    document = {"benchmark": "serve load", "command": " ".join(["benchmarks/serve_load.py", *sys.argv[1:]]),
                "environment": {"date": date, "device": str(mx.default_device()), "machine": platform.machine(),
                                "cpus": os.cpu_count(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                                "kvq": __version__, "commit": commit.stdout.strip()},
                "settings": {"server": " ".join(o for o in load.OPTIONS if o not in ("--api-key", load.KEY)),
                             "model": "tiny random llama (2 layers, 128 positions)",
                             "clients": args.clients, "copies": args.copies, "runs": args.runs},
                "server_start_seconds": round(start_seconds, 2), "figures": figures, "checks": checks}
    out = args.out or ROOT / "benchmarks" / "results" / "serve" / (
        f"{date}-{platform.machine()}-serve-load-{args.clients}x{figures['requests']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    if not all(checks.values()):
        sys.exit(f"failed: {', '.join(name for name, ok in checks.items() if not ok)}")


if __name__ == "__main__":
    main()
