"""Moving handles between processes (never data): the endpoints of the wire formats.

``handles`` (this process's handle server: start, fork, exit drain), ``server``
(:class:`~sharedarrays.transport.server.HandleServer`, a handler table), ``client`` (asking
an exporter's server for handles or growth), ``notices`` (release notices and load reports,
sent by one thread) and ``keeper`` (the client of the per-user keeper process, whose program
is :mod:`sharedarrays.keeper`). It imports protocol, backends and memory.
"""
