"""Does the parent's ordering fence record events in the warm rounds, and how often does
the parent's collector run? (issue 19, session 18)

    python benchmarks/probe_fence_records.py OUT.json

Runs ``python -m sharedarrays bench --only warm --warm-sizes 1M --rounds 151`` in this
process, then prints how many ordering events this process recorded
(``sharedarrays.backends.cuda.sync._records``: 0 means every pickling found the stream
idle) and how many collections of each generation its collector started.

(The run in ``benchmarks/results/nvidia-h200-2026-12-02-session18-fence-records-probe.log``
was made before the ``__main__`` guard below: each spawned worker ran the script again and
its own bench failed at once, as the log shows; the parent's rounds, figures and counts are
unaffected.)
"""

from __future__ import annotations

import gc
import sys


def main(out: str) -> int:
    from sharedarrays import cli
    from sharedarrays.backends.cuda import sync

    counts = {"gen0": 0, "gen1": 0, "gen2": 0}

    def started(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            counts[f"gen{info['generation']}"] += 1

    gc.callbacks.append(started)
    rc = cli.main(
        ["bench", "--only", "warm", "--warm-sizes", "1M", "--rounds", "151", "--json", out]
    )
    print("rc", rc, "parent events recorded:", sync._records, "parent gc:", counts)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
