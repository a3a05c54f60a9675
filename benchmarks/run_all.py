"""Run the whole benchmark with the committed defaults and keep the results.

    python benchmarks/run_all.py            # auto: cuda:0 if usable, else the host
    python benchmarks/run_all.py --device cpu

Writes ``benchmarks/results/<device>-<date>.json`` and ``.png`` (``<device>`` is ``cpu`` or
the GPU's name, e.g. ``nvidia-h200``) and prints the table with the targets. Any other
``bench`` option may be added (see ``python -m sharedarrays bench --help``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    os.chdir(ROOT)  # results land in benchmarks/results of this checkout
    sys.path.insert(0, str(ROOT))
    from sharedarrays.bench.command import main

    sys.exit(main(["--full", *sys.argv[1:]]))
