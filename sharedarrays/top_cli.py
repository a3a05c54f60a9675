"""Command line for the node-wide map: ``python -m sharedarrays top``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

__all__ = ["add_parser", "run", "print_json"]

MAX_SECONDS = 86_400.0
"""The longest ``--interval`` or ``--timeout`` (a day)."""

ENTER = "\x1b[?1049h\x1b[?25l"  # the alternate screen, no cursor
LEAVE = "\x1b[?25h\x1b[?1049l"  # the cursor and the screen the user had
CLEAR = "\x1b[H\x1b[2J"  # home, then clear the screen (before each refresh)


def add_parser(sub: Any) -> None:
    """Add the ``top`` subcommand to ``sub``."""
    top = sub.add_parser(
        "top", help="every shared allocation of this user on this node, who holds it, refreshing"
    )
    top.add_argument("--once", action="store_true", help="print the map once and exit")
    top.add_argument("--json", action="store_true", help="one JSON object (implies --once)")
    top.add_argument(
        "--interval", type=seconds, default=2.0, help="seconds between refreshes (default 2)"
    )
    top.add_argument(
        "--timeout", type=seconds, default=1.0, help="seconds each process is given to answer"
    )
    top.add_argument("--nvml", action="store_true", help="add the driver's per-process GPU memory")


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0, at most :data:`MAX_SECONDS`."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= MAX_SECONDS:  # (False for nan)
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds above 0 and at most {MAX_SECONDS:g}, not {value:g}"
        )
    return value


def print_json(doc: dict[str, Any]) -> None:
    """Print ``doc`` as one line of JSON."""
    print(json.dumps(doc, separators=(",", ":")))


def run(args: argparse.Namespace) -> int:
    """Run ``top``; return the exit status. On a terminal it redraws in place on the
    alternate screen, elsewhere prints each refresh; Ctrl-C and a closed pipe end it (0)."""
    screen = not (args.once or args.json) and sys.stdout.isatty()
    try:
        if screen:
            sys.stdout.write(ENTER)
        try:
            return _loop(args, screen)
        finally:
            if screen:
                sys.stdout.write(LEAVE)
                sys.stdout.flush()
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # ``top | head``: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0


def _loop(args: argparse.Namespace, screen: bool) -> int:
    from sharedarrays.api import nodemap
    from sharedarrays.api.widgets.render import render_node_text

    while True:
        picture = nodemap.node_map(args.timeout)
        checks = None
        if args.nvml:
            from sharedarrays.api.nodemap import cross_check, render_text

            checks = cross_check(picture)
        if args.json:
            doc = picture.to_doc()
            if checks is not None:
                doc["nvml"] = [c.to_doc() for c in checks]
            print_json(doc)
            return 0
        text = render_node_text(picture)
        if checks is not None:
            text += f"\n\n{render_text(checks)}"
        if args.once:
            print(text)
            return 0
        if screen:
            sys.stdout.write(CLEAR + text + f"\n\n(every {args.interval:g} s; Ctrl-C to quit)\n")
        else:
            sys.stdout.write(text + "\n\n")
        sys.stdout.flush()
        time.sleep(args.interval)
