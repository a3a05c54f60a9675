"""Split a bench run's warm figures by the entry that led each round.

    python benchmarks/round_leaders.py [--neighbours METHOD] RESULTS.json [...]

Without an untimed lead-in (``run_rounds``' ``lead_in``, since 82e71b4), a round's first
entry followed the last entry of the round before, a neighbour the Williams design does not
balance: with an even number of entries each entry led its rounds after the same one entry
every time. For each warm size this prints that neighbour, and for each method the median of
its per-round differences over the floor: in all rounds, in the rounds the floor led, in
the rounds the method led, and in the others. (A run made with the lead-in prints the same
split; there every first entry followed the lead-in.)

``--neighbours METHOD`` prints instead, per warm size, METHOD's per-round differences over
the floor grouped by the two entries just before the floor and just before METHOD in the
round (``<X``: the last entry of the round before, for an entry that led), medians first
to last: which neighbour slows which entry.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sharedarrays.bench.rounds import FLOOR, round_order


def _before(names: list[str], index: int, name: str) -> str:
    order = round_order(names, index)
    place = order.index(name)
    return order[place - 1] if place else "<" + round_order(names, index - 1)[-1]


def neighbours(paths: list[str], method: str) -> None:
    for path in paths:
        data = json.loads(Path(path).read_text())
        warmup = data["config"]["warmup"]
        for size, part in data["overhead"]["warm"]["sizes"].items():
            names = part["order"]
            if method not in part["methods"]:
                continue
            groups: dict[tuple[str, str], list[float]] = {}
            for i, diff in enumerate(part["methods"][method]["diffs_us"]):
                key = (_before(names, warmup + i, FLOOR), _before(names, warmup + i, method))
                groups.setdefault(key, []).append(diff)
            print(f"{Path(path).name}, {int(size):,} bytes: {method} over the floor")
            for (floor_after, method_after), diffs in sorted(
                groups.items(), key=lambda kv: statistics.median(kv[1])
            ):
                print(
                    f"  floor after {floor_after:<14} {method} after {method_after:<14} "
                    f"n={len(diffs):>3} median {statistics.median(diffs):+.0f}"
                )


def main(paths: list[str]) -> None:
    if paths[:1] == ["--neighbours"]:
        neighbours(paths[2:], paths[1])
        return
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
