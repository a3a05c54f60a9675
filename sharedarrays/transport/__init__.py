"""Moving handles between processes (never data): the endpoints of the wire formats. It
imports protocol, backends and memory."""
