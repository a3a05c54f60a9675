"""The benchmark: hand an array to a spawn Pool worker, against every peer.

    python benchmarks/bench.py --help
    python benchmarks/bench.py --quick                  # a smoke test, a minute or two
    python benchmarks/bench.py --device cpu --only warm --rounds 31 --json out.json
    python benchmarks/bench.py --full                   # the committed defaults; writes
                                                        # benchmarks/results/<machine>.json, .png

What it measures, and the latest results: docs/performance.md. The harness itself is the
``harness`` package next to this script (``benchmarks/harness/``); this script puts its
folder first on ``sys.path`` (a spawned worker gets the same ``sys.path``, so it imports the
harness's tasks by name too). ``sharedarrays`` is the one Python finds (``PYTHONPATH``, or
the installed package), else the one of this checkout.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
# (found, not imported: a spawned Dask worker runs this file too, and must import sharedarrays
# only after distributed, as ``import sharedarrays`` registers with distributed only then)
if importlib.util.find_spec("sharedarrays") is None:  # (not installed: this checkout's)
    sys.path.append(str(HERE.parent))

if __name__ == "__main__":
    from harness.command import main

    sys.exit(main())
