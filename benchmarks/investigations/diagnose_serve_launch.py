"""Does mlx-lm's own server answer under ``mlx.launch`` where ``kvq serve`` does not? (2 GPUs, NCCL by default.)

Saves the tiny random llama of ``tests/test_distributed.py``, then starts ``mlx_lm.server`` under ``mlx.launch``,
``mlx_lm.server`` alone, and ``kvq serve`` (turboquant 2 bits) under ``mlx.launch``, asks each for 8 greedy tokens
and prints OK with the token ids or FAILED with the reply, followed by the server's stderr. Run from the
repository root: ``python benchmarks/investigations/diagnose_serve_launch.py`` (``KVQ_TEST_DISTRIBUTED_BACKEND=ring`` for TCP).
Result on 2 H200s: ``benchmarks/results/distributed/2026-11-30-h200x2-nccl-serve-diagnosis.log``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
os.environ.setdefault("KVQ_TEST_DISTRIBUTED_BACKEND", "nccl")

import test_distributed as t  # noqa: E402  (its launch helpers and tiny model)

from kvq import models  # noqa: E402


def main() -> None:
    base = Path(tempfile.mkdtemp())
    gguf = base / "tiny.gguf"
    t.write_tiny_gguf(gguf)
    os.environ["KVQ_CACHE_DIR"] = str(base / "cache")
    folder = t.save_tiny_folder(base / "model", models.resolve_model(gguf, progress=False))
    runs = [("mlx_lm", True, ["-m", "mlx_lm.server", "--model", str(folder)]),
            ("mlx_lm", False, ["-m", "mlx_lm.server", "--model", str(folder)]),
            ("kvq", True, ["-m", "kvq.cli", "serve", "--model", str(folder), "--method=turboquant", "--bits=2"])]
    for name, launched, args in runs:
        port = t.free_port()
        command = [*args, "--port", str(port)]
        process = t.start(t.launch_command(*command) if launched else [sys.executable, *command], folder)
        label = f"{name} {'launched' if launched else 'single'}"
        try:
            ids, _ = t.completion_ids(port, t.SERVE_PROMPT, timeout=120)
            print(label, "OK", ids, flush=True)
        except BaseException as exc:  # noqa: BLE001 - reported, then the next server
            print(label, "FAILED", repr(exc)[:1500], flush=True)
        _, err = t.stop(process)
        print(name, "stderr tail:\n", err[-3000:], flush=True)


if __name__ == "__main__":
    main()
