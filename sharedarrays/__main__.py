"""``python -m sharedarrays``: see :mod:`sharedarrays.cli`."""

import sys

from sharedarrays.cli import main

if __name__ == "__main__":
    sys.exit(main())
