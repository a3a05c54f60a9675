"""Another OS user for the tests that check what a different user may not do."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess

NAME = "sa-test-other"


def other_user() -> str | None:
    """The name of a second local user (made with ``useradd`` when running as root), or
    ``None`` where none can be had (not root, no ``useradd``)."""
    if os.getuid() != 0:
        return None
    try:
        pwd.getpwnam(NAME)
    except KeyError:
        useradd = shutil.which("useradd")
        if useradd is None:
            return None
        r = subprocess.run(
            [useradd, "--no-create-home", "--shell", "/usr/sbin/nologin", NAME], capture_output=True
        )
        if r.returncode != 0:
            return None
    return NAME


def become(name: str) -> None:
    """Run this process as the user ``name`` from here on (a forked child of a root test
    process): no supplementary groups, then the user's group, then the user."""
    pw = pwd.getpwnam(name)
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
