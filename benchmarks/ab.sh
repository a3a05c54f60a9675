#!/usr/bin/env bash
# A/B of a speed change: the bench's warm, cold and many parts on two versions of the
# library, alternated in both orders, on one machine.
#
#   bash benchmarks/ab.sh A_TREE B_TREE [PASSES] [-- BENCH_OPTIONS...]
#
# A tree is a folder holding a `sharedarrays` package (`.` is this checkout), e.g.
#   mkdir -p /tmp/a && git archive REV sharedarrays | tar -x -C /tmp/a
# Each pass runs this checkout's harness (benchmarks/bench.py) once on each tree: A then B
# on odd passes, B then A on even ones, so that neither always meets the machine as the
# other left it. In each run the warm and cold parts time 1,001 interleaved rounds per size
# (each round times the floor and every method once, in a balanced order: 1,001 pairs of
# the method and the floor of its own round, per method and size). PASSES (default 4) is
# rounded up to an even number. BENCH_OPTIONS are added after the defaults below (the last
# of an option wins), e.g. `-- --device cpu --rounds 31` for a quick look.
#
# Logs and JSON go to $OUT (./artifacts) as ab-<A|B>-<pass>.log/.json; at the end, the
# figures of every run, A and B side by side, and the median over the passes of each.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ $# -ge 2 ] || { sed -n '2,/^set -eu/p' "$0" | sed '$d'; exit 2; }
a=$(cd "$1" && pwd)
b=$(cd "$2" && pwd)
shift 2
passes=4
if [ $# -gt 0 ] && [ "$1" != "--" ]; then passes=$1; shift; fi
passes=$(( (passes + 1) / 2 * 2 ))
[ $# -gt 0 ] && [ "$1" = "--" ] && shift
out=${OUT:-$(pwd)/artifacts}
mkdir -p "$out"
defaults=(--only warm,cold,many --rounds 1001 --warm-sizes 1M,1G --cold-sizes 1M,1G)
for tree in "$a" "$b"; do  # (the package each run measures must be the tree's)
  found=$(cd "$out" && PYTHONPATH="$tree" python3 -c 'import sharedarrays; print(sharedarrays.__file__)')
  case "$found" in "$tree"/*) ;; *) echo "$tree: python3 imports $found instead" >&2; exit 2 ;; esac
done
for i in $(seq 1 "$passes"); do
  order=(A B); [ $((i % 2)) -eq 0 ] && order=(B A)
  for which in "${order[@]}"; do
    tree=$a; [ "$which" = B ] && tree=$b
    echo "== pass $i: $which ($tree)"
    (cd "$out" && PYTHONPATH="$tree" python3 "$root/benchmarks/bench.py" "${defaults[@]}" "$@" \
        --json "$out/ab-$which-$i.json") >"$out/ab-$which-$i.log" 2>&1 \
      || echo "$which pass $i failed: see $out/ab-$which-$i.log"
  done
done
python3 - "$out" "$passes" <<'PY'
import json, statistics, sys
from pathlib import Path

out, passes = Path(sys.argv[1]), int(sys.argv[2])
rows: dict[str, dict[str, list[float]]] = {}
for which in "AB":
    for i in range(1, passes + 1):
        path = out / f"ab-{which}-{i}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        for kind, part in data.get("overhead", {}).items():
            for size, case in part.get("sizes", {}).items():
                for name, r in case.get("methods", {}).items():
                    key = f"{kind} {int(size) >> 20}M {name} over the floor, us"
                    rows.setdefault(key, {"A": [], "B": []})[which].append(r["median_us"])
        for name, r in data.get("many", {}).get("methods", {}).items():
            key = f"many {name}, arrays/s"
            rows.setdefault(key, {"A": [], "B": []})[which].append(r["arrays_per_s"])
        extra = {
            "many memory / payload bytes": data.get("many", {}).get("memory_ratio"),
            "bandwidth shared, GB/s": data.get("bandwidth", {}).get("shared_GBps"),
            "bandwidth shared / plain": data.get("bandwidth", {}).get("ratio"),
        }
        for key, value in extra.items():
            if isinstance(value, (int, float)):
                rows.setdefault(key, {"A": [], "B": []})[which].append(value)
def f(v: float) -> str:
    return f"{v:.1f}" if abs(v) >= 100 else f"{v:.3f}"


print(f"\n{'figure':<44}{'A (median of passes)':>22}{'B':>12}{'B - A':>10}")
for key, got in rows.items():
    if got["A"] and got["B"]:
        ma, mb = statistics.median(got["A"]), statistics.median(got["B"])
        print(f"{key:<44}{f(ma):>22}{f(mb):>12}{f(mb - ma):>10}")
        print(f"{'':<8}A: {', '.join(map(f, got['A']))}")
        print(f"{'':<8}B: {', '.join(map(f, got['B']))}")
PY
