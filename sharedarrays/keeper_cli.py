"""Command line for named arrays and the keeper: ``python -m sharedarrays ls | rm | keeper |
status`` (added to :mod:`sharedarrays.cli`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

__all__ = ["COMMANDS", "add_parsers", "run"]

COMMANDS = ("ls", "rm", "keeper", "status")


def add_parsers(sub: Any) -> None:
    """Add the ``ls``, ``rm``, ``keeper`` and ``status`` subcommands to ``sub``."""
    ls = sub.add_parser("ls", help="list this user's named arrays")
    ls.add_argument("--all", action="store_true", help="also parked and unlinked arrays")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    rm = sub.add_parser("rm", help="unlink named arrays (memory returns when unused)")
    rm.add_argument("names", nargs="+", metavar="NAME")
    k = sub.add_parser("keeper", help="start this user's keeper (in the background)")
    k.add_argument("--foreground", action="store_true", help="run it in this process")
    k.add_argument(
        "--idle", type=float, default=None, help="seconds to wait holding nothing before exiting"
    )
    sub.add_parser("status", help="show this user's keeper")


def _size(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g}{unit}"
    return str(n)


def run(args: argparse.Namespace) -> int:
    """Run one of :data:`COMMANDS`; return the exit status."""
    from sharedarrays.api import named
    from sharedarrays.errors import HandleUnavailable, NameNotFound, SharedArrayError
    from sharedarrays.keeper.daemon import main as keeper_main
    from sharedarrays.protocol.keeper import Status
    from sharedarrays.transport import keeper

    if args.command == "ls":
        rows = named.list_named(parked=args.all)
        if args.json:
            for r in rows:
                print(
                    json.dumps(
                        {
                            "name": r.name,
                            "id": r.id,
                            "shape": list(r.shape),
                            "dtype": r.dtype.str,
                            "device": str(r.device),
                            "size": r.size,
                            "creator": r.creator,
                            "created": r.created,
                            "pids": list(r.pids),
                            "linked": r.linked,
                            "readonly": r.readonly,
                        }
                    )
                )
            return 0
        print(
            f"{'NAME':<24} {'SHAPE':<16} {'DTYPE':<8} {'DEVICE':<7} {'SIZE':>7} "
            f"{'CREATOR':>8} {'CREATED':<19} PIDS"
        )
        for r in rows:
            label = r.name or f"(parked {r.id[:8]})"
            if not r.linked:
                label += " (unlinked)"
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created))
            print(
                f"{label:<24} {r.shape!s:<16} {r.dtype.name:<8} {r.device!s:<7} "
                f"{_size(r.size):>7} {r.creator:>8} {stamp:<19} "
                f"{','.join(map(str, r.pids)) or '-'}"
            )
        return 0
    if args.command == "rm":
        status = 0
        for name in args.names:
            try:
                named.unlink(name)
            except (NameNotFound, ValueError, TypeError) as e:
                print(f"rm: {e}", file=sys.stderr)
                status = 1
        return status
    if args.command == "keeper":
        if args.idle is not None:
            os.environ["SHAREDARRAYS_KEEPER_IDLE"] = str(args.idle)
        if args.foreground:
            rc = keeper_main()
            if rc == 3:
                print(f"a keeper is running already (pid {keeper.running_pid()})", file=sys.stderr)
            return rc
        print(f"keeper running, pid {keeper.ensure_running()}")
        return 0
    if args.command == "status":
        try:
            status, body, _ = keeper.request(Status(), start=False)
        except HandleUnavailable as e:
            print(f"no keeper running ({e})")
            return 1
        except SharedArrayError as e:  # it runs, but is busy or stopped
            print(f"the keeper runs but cannot be asked: {e}")
            return 1
        keeper.raise_for(status, body, "status")
        for key, value in body.items():
            print(f"{key:<12} {value}")
        return 0
    return 2  # pragma: no cover
