"""``python -m sharedarrays.keeper``: run the keeper in this process until it is idle."""

import sys

from sharedarrays.keeper.daemon import main

sys.exit(main())
