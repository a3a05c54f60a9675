#!/usr/bin/env bash
# A/B of the warm handoff on the GPU machine: for each tree in turn, `warm_split.py` (where a
# warm handoff's time goes: pickling, unpickling, task) and the bench's warm part (1 MiB and
# 1 GiB, interleaved rounds with torch and the bound entry), PASSES times, alternated, so
# that every tree meets the same machine state.
#
#   bash benchmarks/ab_warm.sh PASSES TREE [TREE ...]
#
# A TREE is a folder holding a `sharedarrays` package, e.g. made with
#   mkdir -p artifacts/t0 && git archive REV sharedarrays | tar -x -C artifacts/t0
# (carry the folders to the device). After the passes, `cold_handoff.py` for each tree (each
# side of a warm handoff with the caches flushed: 256 MiB, more than the H200 machine's
# last-level cache). The bench runs from inside each tree: `python -m`
# puts the current folder first on sys.path, so PYTHONPATH alone would not choose the tree.
# The docs/performance.md sections of issue 19 quote its output as "A/B" runs.
set -euo pipefail
root=$(pwd)
passes=$1
shift
for i in $(seq 1 "$passes"); do
  for t in "$@"; do
    echo "== $t (pass $i)"
    PYTHONPATH="$root/$t" timeout 100 python3 "$root/benchmarks/warm_split.py" \
        --device cuda:0 --rounds 301 2>&1 \
      | grep -E "sharedarra - floor|hook\+fence - floor|sa - hook\+fence" || true
    (cd "$root/$t" && timeout 100 python3 -m sharedarrays bench --only warm \
        --warm-sizes 1M,1G --rounds 301 --skip table 2>&1 \
      | grep -E "warm +1[MG] (sharedarrays|torch|bound)") || true
  done
done
for t in "$@"; do
  echo "== $t (cold_handoff)"
  PYTHONPATH="$root/$t" timeout 100 python3 "$root/benchmarks/cold_handoff.py" \
      --device cuda:0 --flush 256M --iterations 151 2>&1 \
    | grep -E "flush|sharedarrays -" || true
done
