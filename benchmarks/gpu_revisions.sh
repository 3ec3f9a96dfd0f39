#!/usr/bin/env bash
# Build wheels of kvq's five distributions at two git revisions, for a GPU host without network:
#
#   bash benchmarks/gpu_revisions.sh BEFORE AFTER DEST     e.g. bash benchmarks/gpu_revisions.sh ff5cf67 HEAD .gpu/rev
#
# DEST/before/*.whl and DEST/after/*.whl (each revision's packages, with their entry points), and DEST/after/tree/
# (AFTER's tests/ and benchmarks/*.{py,sh,json}, so the GPU host runs the committed tests, not a working tree in flux).
# On the GPU host (see .gpu/install.sh for MLX itself):
#   pip install -q --no-index --no-deps --target /tmp/site-before DEST/before/*.whl      (and after)
#   PYTHONPATH=/tmp/kvq-site:/tmp/site-after python3 DEST/after/tree/benchmarks/record_outputs.py ...
set -euo pipefail
before=${1:?usage: gpu_revisions.sh BEFORE AFTER DEST}; after=${2:?}; dest=${3:?}
root=$(git rev-parse --show-toplevel)
rm -rf "$dest"; mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
for side in before after; do
  rev=${!side}
  work=$(mktemp -d)
  scripts=$(git -C "$root" ls-tree --name-only "$rev" benchmarks/ | grep -E '\.(py|sh|json)$')  # the revision's, not the tree's
  # (the .sh and .json: gpu_session.sh and the variants its durations step reads, profile_variants.json)
  git -C "$root" archive "$rev" kvq_core kvq_metal kvq_backends_turboquant kvq_backends_qjl kvq_backends_vecinfer \
    tests $scripts | tar -x -C "$work"
  mkdir -p "$dest/$side"
  for pkg in kvq_core kvq_metal kvq_backends_turboquant kvq_backends_qjl kvq_backends_vecinfer; do
    uv build --quiet --wheel --out-dir "$dest/$side" "$work/$pkg"
  done
  if [ "$side" = after ]; then mkdir -p "$dest/after/tree" && cp -r "$work/tests" "$work/benchmarks" "$dest/after/tree/"; fi
  git -C "$root" rev-parse --short "$rev" > "$dest/$side/REVISION"
  rm -rf "$work"
done
du -sh "$dest"
