"""The wire formats, one module each, pure: bytes in, typed frozen records out.

Every decoder refuses malformed input with a :class:`~sharedarrays.SharedArrayError`. It
imports only the foundation (errors, settings, process), so every layer above may use it.
"""
