"""``python -m sharedarrays.bench``: the same as ``python -m sharedarrays bench``."""

import sys

from sharedarrays.bench.command import main

if __name__ == "__main__":
    sys.exit(main())
