"""Command line for named arrays and the keeper: ``python -m sharedarrays ls | rm | keeper |
status``. ``ls`` adds the node-wide map's columns (:mod:`sharedarrays.api.nodemap`), and
``rm`` also frees parked and orphaned allocations by id."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from typing import Any

from sharedarrays.top_cli import seconds

__all__ = ["COMMANDS", "add_parsers", "run"]

COMMANDS = ("ls", "rm", "keeper", "status")

_NODE_KEYS = ("state", "backend", "lost", "holders", "exporter", "age", "kept", "in_flight")
_LS_COLUMNS = tuple(  # (heading, format spec)
    re.findall(
        r"(\w+):(\S*)",
        "NAME:<24 NAMESPACE:<20 SHAPE:<16 DTYPE:<8 DEVICE:<7 SIZE:>9 CREATOR:>8 CREATED:<19 "
        "PIDS:<12 STATE:<9 BACKEND:<8 LOST:>9 AGE:>5 HOLDERS:",
    )
)


def add_parsers(sub: Any) -> None:
    """Add the ``ls``, ``rm``, ``keeper`` and ``status`` subcommands to ``sub``."""
    ls = sub.add_parser("ls", help="list this user's named arrays (of this namespace)")
    ls.add_argument("--all", action="store_true", help="also parked and unlinked arrays")
    ls.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="the names of every namespace, global ones included (not only this project's)",
    )
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    rm = sub.add_parser(
        "rm", help="unlink named arrays, free parked and orphaned allocations (by name or id)"
    )
    rm.add_argument("names", nargs="+", metavar="NAME|ID")
    rm.add_argument(
        "--yes", action="store_true", help="do not ask before dropping payloads in flight"
    )
    k = sub.add_parser("keeper", help="start this user's keeper (in the background)")
    k.add_argument("--foreground", action="store_true", help="run it in this process")
    k.add_argument(
        "--idle",
        type=seconds,
        default=None,
        help="seconds to wait holding nothing before exiting (above 0, at most a day)",
    )
    sub.add_parser("status", help="show this user's keeper")


def run(args: argparse.Namespace) -> int:
    """Run one of :data:`COMMANDS`; return the exit status."""
    commands = {"ls": _ls, "rm": _rm, "keeper": _keeper, "status": _status}
    return commands[args.command](args)


def _ls(args: argparse.Namespace) -> int:
    from sharedarrays.api import named, nodemap
    from sharedarrays.api.widgets.model import fmt_bytes
    from sharedarrays.api.widgets.render import COLUMNS, row_cells
    from sharedarrays.errors import SharedArrayError

    try:
        rows = named.list_named(parked=args.all, all_namespaces=args.all_namespaces)
    except SharedArrayError as e:  # the keeper runs but is stopped, busy or another's
        print(f"ls: {e}", file=sys.stderr)
        return 1
    seen = {r.alloc_id: r for r in nodemap.node_map().allocations} if rows else {}
    if args.json:
        for r in rows:
            more = seen[r.id].to_doc() if r.id in seen else {}
            doc = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}  # (tuples: lists)
            doc.update(dtype=r.dtype.str, device=str(r.device))
            del doc["allow_pids"]
            print(json.dumps({**doc, **{k: more[k] for k in _NODE_KEYS if k in more}}))
        return 0
    lines = [[name for name, _ in _LS_COLUMNS]]
    for r in rows:
        node = dict(zip(COLUMNS, row_cells(seen[r.id]))) if r.id in seen else {}
        lines.append(
            [
                (r.name or f"(parked {r.id[:8]})") + ("" if r.linked else " (unlinked)"),
                "-" if r.name is None else r.namespace or "/ (global)",
                str(r.shape),
                r.dtype.name,
                str(r.device),
                fmt_bytes(r.size),
                r.creator,
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created)),
                ",".join(map(str, r.pids)) or "-",
                *(node.get(c, "-") for c in ("STATE", "BACKEND", "LOST", "AGE", "HOLDERS")),
            ]
        )
    for cells in lines:
        print(" ".join(f"{cell:{spec}}" for cell, (_, spec) in zip(cells, _LS_COLUMNS)))
    return 0


def _ask(question: str) -> bool:
    """Ask on the terminal; no terminal (a script) is a no."""
    if not sys.stdin.isatty():
        print(f"{question} (not asked: no terminal; pass --yes)", file=sys.stderr)
        return False
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def _rm(args: argparse.Namespace) -> int:
    """Unlink each name; free each id (or its start) of a parked or orphaned allocation."""
    from sharedarrays.api import named, nodemap
    from sharedarrays.errors import NameNotFound, SharedArrayError

    status = 0
    for target in args.names:
        try:
            try:
                named.unlink(target)
                continue
            except (NameNotFound, ValueError, TypeError):
                if not (len(target) >= 4 and all(c in "0123456789abcdef" for c in target)):
                    raise
            row = nodemap.find(nodemap.node_map(), target)
            done = nodemap.free(row, (lambda q: True) if args.yes else _ask)
        except (SharedArrayError, ValueError, TypeError) as e:
            print(f"rm: {e}", file=sys.stderr)
            status = 1
            continue
        print(f"{row.alloc_id}: " + ("; ".join(done) or "nothing holds it any more"))
        if done == [nodemap.LEFT_ALONE]:  # (nothing was freed: a script must see it)
            status = 1
    return status


def _keeper(args: argparse.Namespace) -> int:
    from sharedarrays.keeper.daemon import main as keeper_main
    from sharedarrays.transport import keeper

    if args.idle is not None:
        os.environ["SHAREDARRAYS_KEEPER_IDLE"] = str(args.idle)
    if not args.foreground:
        print(f"keeper running, pid {keeper.ensure_running()}")
        return 0
    rc = keeper_main()
    if rc == 3:
        print(f"a keeper is running already (pid {keeper.running_pid()})", file=sys.stderr)
    return rc


def _status(args: argparse.Namespace) -> int:
    from sharedarrays.errors import HandleUnavailable, SharedArrayError
    from sharedarrays.protocol.keeper import Status
    from sharedarrays.transport import keeper

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
