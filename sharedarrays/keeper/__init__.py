"""The keeper daemon, ``python -m sharedarrays.keeper`` (:mod:`sharedarrays.keeper.daemon`)."""
