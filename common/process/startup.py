"""What a process checks before it starts serving, so that a start that cannot work ends with
status 2 and one line naming the flag, its variable and the value (as a bad value does, see
modelyard.process.settings), not with a traceback: a listen address that is taken or not local, a
folder that is not there."""

from __future__ import annotations

import errno
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from modelyard.process.lifecycle import EXIT_USAGE, usage_line
from modelyard.process.settings import split_address


def usage_error(prog: str, prefix: str, name: str, message: str, hint: str = "") -> int:
    """Print `prog: error: argument --name: message (env PREFIX_NAME)hint` and give EXIT_USAGE."""
    print(usage_line(prog, prefix, name, message, hint), file=sys.stderr)
    return EXIT_USAGE


def unbindable(address: str) -> str | None:
    """Why a server could not listen on HOST:PORT, or None. The probe binds as the servers do
    (SO_REUSEADDR: a port left in TIME_WAIT by the last run is free) and lets go at once."""
    host, port = split_address(address)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"host {host!r} is unknown ({exc.strerror})"
    failures: list[OSError] = []
    for family, kind, proto, _, sockaddr in found:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                failures.append(exc)
    # A name such as localhost may resolve to an IPv6 address the host lacks: the servers bind
    # what they can, so only a taken port, or no address at all, stops the start.
    taken = [e for e in failures if e.errno == errno.EADDRINUSE]
    if taken or (failures and len(failures) == len(found)):
        first = (taken or failures)[0]
        return (first.strerror or str(first)).lower()
    return None


def check_listeners(settings: object, names: Sequence[str], prefix: str, prog: str) -> int | None:
    """EXIT_USAGE (after its one line) for the first of the settings `names` whose address cannot
    be listened on; None when all can (an empty address is a listener turned off)."""
    for name in names:
        value = getattr(settings, name)
        reason = unbindable(value) if value else None
        if reason is not None:
            return usage_error(prog, prefix, name, f"cannot listen on {value!r}: {reason}")
    return None


def check_folder(settings: object, name: str, prefix: str, prog: str, hint: str = "") -> int | None:
    """EXIT_USAGE (after its one line, ending with `hint`) when setting `name` is not a folder;
    None when it is."""
    value = Path(getattr(settings, name))
    if value.is_dir():
        return None
    what = "does not exist" if not value.exists() else "is not a folder"
    return usage_error(prog, prefix, name, f"{str(value)!r} {what}", hint)
