"""The keeper daemon: a program of its own (``python -m sharedarrays.keeper``) that holds
the handles of named and parked arrays for one user (:mod:`sharedarrays.keeper.daemon`)."""
