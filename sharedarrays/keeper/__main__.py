"""``python -m sharedarrays.keeper``: run the keeper in this process until it is idle."""

from sharedarrays.keeper.daemon import main

raise SystemExit(main())
