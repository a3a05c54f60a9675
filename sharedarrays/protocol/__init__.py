"""The wire formats, one module each, pure: bytes in, typed frozen records out (malformed
input: a SharedArrayError). It imports only the foundation (errors, settings, process)."""
