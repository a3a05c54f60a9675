#!/usr/bin/env bash
# Run the bench's warm handoff, cold handoff and 10,000 x 4 KiB parts on two versions of the
# library in one call, alternated (before, after, before, after), so that both meet the same
# machine state. Used to show that a change that should not touch speed did not.
#
#   bash benchmarks/compare.sh BEFORE_DIR [ROUNDS]
#
# BEFORE_DIR holds the old package (e.g. `git archive REV sharedarrays | tar -x -C DIR`);
# the working tree is "after". Logs go to $OUT (or ./artifacts) as compare-{before,after}-N.log;
# a summary of the three figures of each run is printed at the end.
set -euo pipefail
before=$(cd "$1" && pwd)
rounds=${2:-2}
after=$(pwd)
out=${OUT:-$after/artifacts}
mkdir -p "$out"
device=${SA_DEVICE:-cuda:0}
args=(bench --device "$device" --sizes 1M,1G --methods sharedarrays,torch
      --skip bandwidth,scaling --case-seconds 2 --repeats 11)
# a tree whose bench has the interleaved warm / cold rounds runs them at the same sizes
# (1M,1G: not the default 32G cold size, which would dominate the call)
rounds_args=(--warm-sizes 1M,1G --cold-sizes 1M,1G)
for i in $(seq 1 "$rounds"); do
  for which in before after; do
    tree=$before; [ "$which" = after ] && tree=$after
    extra=()
    if (cd "$out" && PYTHONPATH="$tree" python3 -m sharedarrays bench --help) \
        | grep -q -- --cold-sizes; then
      extra=("${rounds_args[@]}")
    fi
    # run from the output folder so neither tree's cwd shadows the other
    (cd "$out" && PYTHONPATH="$tree" python3 -m sharedarrays "${args[@]}" ${extra[@]+"${extra[@]}"}) \
      > "$out/compare-$which-$i.log" 2>&1 || echo "$which $i failed: see compare-$which-$i.log"
  done
done
for f in "$out"/compare-*.log; do
  echo "== $(basename "$f")"
  # old trees: 'warm handoff - floor' (pairs); new trees: '<warm|cold> <size> <method> over
  # the floor' (interleaved rounds) and a line per method with 'arrays/s'
  grep -E 'warm handoff - floor|over the floor|arrays/s|sharedarrays-cold +handoff' "$f" || true
done
