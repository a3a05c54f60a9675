"""The wire formats, one module each, pure: bytes in, typed frozen records out.

``payload`` (what a pickle carries), ``handles`` (the handle server's requests, replies and
notices), ``keeper`` (the keeper's requests and replies), ``token`` (the ordering token) and
``unix`` (the one Unix-socket helper: runtime directory, peer credentials, same-user
connect, fd batches). Every decoder refuses malformed input with a
:class:`~sharedarrays.SharedArrayError`. This layer imports only the foundation (errors,
settings, process), so every layer above, backends included, may use it.
"""
