#!/usr/bin/env bash
# Which earlier test leaves state that breaks a later one on the GPU (issue #49)?
#   bash benchmarks/investigations/gpu_pollution.sh [TARGET] [FILES...]
# Runs TARGET (default: the rotating cache's gpt_oss chunked-prefill test, which fails on an H100 after other tests
# in one process and passes alone) after each of FILES in turn (default: every test file the GPU suite runs), one
# pytest process per pair, and prints the pairs where TARGET fails. Logs under $OUT (default /tmp/out).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
target=${1:-"tests/test_rotating_cache.py::test_chunked_prefill_gives_each_query_its_token_by_token_view"}
shift || true
files=${*:-$(ls tests/test_*.py)}
for f in $files; do
  log="$OUT/pollution_$(basename "$f" .py).log"
  MLX_ENABLE_TF32=0 timeout ${PAIR_TIMEOUT:-240} python3 -m pytest -q --tb=line -p no:cacheprovider --rootdir . \
    "$f" "$target" > "$log" 2>&1
  grep -q "FAILED ${target%%::*}" "$log" && echo "after $f: $(grep "FAILED ${target%%::*}" "$log" | head -1)"
done
echo done
