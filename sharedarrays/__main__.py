"""``python -m sharedarrays``: see :mod:`sharedarrays.cli`."""

from sharedarrays.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
