"""Moving handles between processes (never data): the endpoints of the wire formats.

``handles``, ``server``, ``client``, ``notices`` and ``keeper`` (the keeper's client). It
imports protocol, backends and memory.
"""
