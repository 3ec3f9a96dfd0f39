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
