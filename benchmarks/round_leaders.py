"""Split a bench run's warm figures by the entry that led each round.

    python benchmarks/round_leaders.py RESULTS.json [...]

Without an untimed lead-in (``run_rounds``' ``lead_in``, since 82e71b4), a round's first
entry followed the last entry of the round before, a neighbour the Williams design does not
balance: with an even number of entries each entry led its rounds after the same one entry
every time. For each warm size this prints that neighbour, and for each method the median of
its per-round differences over the floor: in all rounds, in the rounds the floor led, in
the rounds the method led, and in the others. (A run made with the lead-in prints the same
split; there every first entry followed the lead-in.)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sharedarrays.bench.rounds import FLOOR, round_order


def main(paths: list[str]) -> None:
    for path in paths:
        data = json.loads(Path(path).read_text())
        warmup = data["config"]["warmup"]
        for size, part in data["overhead"]["warm"]["sizes"].items():
            names, count = part["order"], part["rounds"]
            leaders = [round_order(names, warmup + i)[0] for i in range(count)]
            before = {leaders[i]: round_order(names, warmup + i - 1)[-1] for i in range(1, count)}
            print(f"{Path(path).name}, {int(size):,} bytes; led after: {before}")
            for name, figures in part["methods"].items():
                diffs = figures["diffs_us"]
                split = {
                    "all": diffs,
                    "floor led": [d for d, lead in zip(diffs, leaders) if lead == FLOOR],
                    f"{name} led": [d for d, lead in zip(diffs, leaders) if lead == name],
                    "others led": [
                        d for d, lead in zip(diffs, leaders) if lead not in (FLOOR, name)
                    ],
                }
                cells = [
                    f"{label} {statistics.median(v):+.0f} (n={len(v)})"
                    for label, v in split.items()
                    if v
                ]
                print(f"  {name:<13} " + "; ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1:])
