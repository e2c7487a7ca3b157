"""The sidecar's state file (`--state-file`): admin weight changes and rollouts, kept across restarts;
and the audit log, one line per accepted change.

The file is JSON, rewritten whole after each change: written to a temporary file beside it, flushed
to disk and renamed over the old one (os.replace), in the executor, so a crash leaves the old file
or the new one, never half of one, and the event loop never waits on the disk. Writes are
coalesced: while one is running, further changes mark the state dirty and the next write takes
them all. A missing file is an empty state; a file that is not the sidecar's state is an error at
start (the sidecar refuses to start rather than drop what an operator set).

Audit lines go to the `modelyard.sidecar.audit` logger (INFO), one per change:

    audit: model=scaler canary_weight 10 -> 25 by=token:3f2a9c1e@10.0.0.7:51234 at=2026-12-01T12:00:00Z
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
audit_log = logging.getLogger("modelyard.sidecar.audit")

FORMAT = 1


class StateError(ValueError):
    """The state file cannot be read as the sidecar's state."""


def load_state(path: Path | None) -> dict[str, Any]:
    """The saved state (empty without a file); StateError for a file that is not one."""
    if path is None:
        return {}
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise StateError(f"state file {path}: cannot read it ({exc})") from exc
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise StateError(f"state file {path}: not JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StateError(f"state file {path}: not a sidecar state file (format {FORMAT})")
    return doc


def write_atomically(path: Path, doc: dict[str, Any]) -> None:
    """Blocking: run it in the executor."""
    data = json.dumps({"format": FORMAT, **doc}, indent=1, sort_keys=True).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class StateFile:
    """Writes `snapshot()` to the file after changes, one write at a time, off the event loop."""

    def __init__(self, path: Path | None, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.path = path
        self._snapshot = snapshot
        self._dirty = False
        self._writer: asyncio.Task[None] | None = None

    def changed(self) -> None:
        """Something in the state changed: write it soon (on the running loop)."""
        if self.path is None:
            return
        self._dirty = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # before the sidecar runs: Sidecar.start writes it
        if self._writer is None or self._writer.done():
            self._writer = loop.create_task(self._write())

    async def _write(self) -> None:
        assert self.path is not None
        loop = asyncio.get_running_loop()
        while self._dirty:
            self._dirty = False
            doc = self._snapshot()  # taken on the loop: a consistent view
            try:
                await loop.run_in_executor(None, write_atomically, self.path, doc)
            except OSError as exc:
                log.error("state file %s: cannot write it (%s); changes hold until a restart", self.path, exc)

    async def flush(self) -> None:
        """Wait for the writes asked for so far (at shutdown, and in tests)."""
        while self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)


def who(token: str | None, peer: str) -> str:
    """The audit line's author: the token's fingerprint (never the token) and the peer
    (`token:3f2a9c1e@10.0.0.7:51234`), or the peer alone without a token (`peer:10.0.0.7:51234`)."""
    if token:
        return f"token:{hashlib.sha256(token.encode()).hexdigest()[:8]}@{peer or '-'}"
    return f"peer:{peer or '-'}"


def audit(what: str, by: str, at: float) -> None:
    when = datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    audit_log.info("audit: %s by=%s at=%s", what, by or "-", when)
