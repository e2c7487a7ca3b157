"""The sidecar's state file (`--state-file`): admin weight changes and rollouts, kept across restarts;
and the audit log, one line per accepted change.

The file is JSON, rewritten whole after changes: written to a temporary file beside it
(`.<name>.<random>`), fsynced, renamed over the old one (os.replace) and the folder fsynced, in the
executor, so a crash (SIGKILL, power loss) leaves the old file or the new one, never half of one,
and the event loop never waits on the disk. Writes are batched: while one runs, further changes
wait for the next, which takes them all. `StateFile.durable()` returns once every change made
before it was called is on disk (or raises StateWriteError): the admin endpoint answers a change
only then, so an acknowledged change survives a SIGKILL.

A missing file is an empty state. Anything else that is not the sidecar's state (not a regular
file: a folder, a FIFO, a symlink; empty, not UTF-8, not JSON, a non-finite number, the wrong
shape) is a StateError naming the file and what is wrong (the sidecar refuses to start rather than
drop what an operator set; sidecar/routes/saved.py checks the contents). Temporary files a crash left
beside it are removed at start (`remove_stale`).

Audit lines go to the `modelyard.sidecar.audit` logger (INFO), one per change:

    audit: model=scaler canary_weight 10 -> 25 by=token:3f2a9c1e@10.0.0.7:51234 at=2026-12-01T12:00:00Z
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import errno
import hashlib
import json
import logging
import math
import os
import re
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
audit_log = logging.getLogger("modelyard.sidecar.audit")

FORMAT = 1
MAX_BYTES = 64 * 1024 * 1024  # far above what 1024 routes and their rollouts take
_KINDS = {
    stat.S_IFDIR: "a folder",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


class StateError(ValueError):
    """The state file cannot be read as the sidecar's state."""


class StateWriteError(OSError):
    """A change could not be written to the state file (it applies, but is not kept yet)."""


def _not_finite(text: str) -> float:
    raise ValueError(f"{text} is not a finite number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999
        raise ValueError(f"{text[:32]} is not a finite number")
    return value


def parse_json(raw: bytes, where: str) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity, no number that is infinite as a float. ValueError."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where} is not UTF-8 text (byte {exc.start})") from None
    try:
        return json.loads(text, parse_constant=_not_finite, parse_float=_finite)
    except RecursionError:
        raise ValueError(f"{where} is nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"{where} is not JSON: {exc}") from None


def _read(path: Path) -> bytes | None:
    """The file's bytes (None: there is none); StateError for one that is not a regular file. Never
    blocks on a FIFO (checked before it is opened, and opened non-blocking without following a
    symlink: the kind is checked again on what was opened)."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        if not path.parent.is_dir():
            raise StateError(f"state file {path}: its folder {path.parent} does not exist") from None
        return None
    except OSError as exc:
        raise StateError(f"state file {path}: cannot read it ({exc.strerror or exc})") from None
    if stat.S_ISLNK(found.st_mode):
        # Each write renames a new file over the path, which would replace the link: name the file.
        raise StateError(f"state file {path}: is a symbolic link (name the file it points to)")
    if not stat.S_ISREG(found.st_mode):
        kind = _KINDS.get(stat.S_IFMT(found.st_mode), "not a regular file")
        raise StateError(f"state file {path}: is {kind}, not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StateError(f"state file {path}: is a symbolic link (name the file it points to)") from None
        raise StateError(f"state file {path}: cannot read it ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as opened:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between the check and the open
            raise StateError(f"state file {path}: is not a regular file")
        try:
            raw = opened.read(MAX_BYTES + 1)
        except OSError as exc:
            raise StateError(f"state file {path}: cannot read it ({exc.strerror or exc})") from None
    if len(raw) > MAX_BYTES:
        raise StateError(f"state file {path}: is over {MAX_BYTES} bytes (not a sidecar state file)")
    return raw


def load_state(path: Path | None) -> dict[str, Any]:
    """The saved state (empty without a file); StateError for a file that is not one. The sections'
    contents are checked by sidecar/routes/saved.py."""
    if path is None:
        return {}
    raw = _read(path)
    if raw is None:
        return {}
    if not raw.strip():
        raise StateError(f"state file {path}: is empty (not a sidecar state file; remove it to start afresh)")
    try:
        doc = parse_json(raw, "it")
    except ValueError as exc:
        raise StateError(f"state file {path}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StateError(f"state file {path}: not a sidecar state file (an object with format {FORMAT})")
    return doc


def _stale(path: Path) -> re.Pattern[str]:
    # What tempfile.mkstemp(prefix=".<name>.") makes: 8 characters of its alphabet.
    return re.compile(re.escape(f".{path.name}.") + r"[a-z0-9_]{8}")


def remove_stale(path: Path) -> list[Path]:
    """Remove the temporary files a crash left beside the state file (before any write of ours)."""
    pattern = _stale(path)
    removed = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return []
    for entry in entries:
        if pattern.fullmatch(entry.name) and not entry.is_dir(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    if removed:
        log.warning("state file %s: removed %d temporary file(s) a crash left", path, len(removed))
    return removed


def write_atomically(path: Path, doc: dict[str, Any]) -> None:
    """Blocking: run it in the executor. On disk when it returns (file and folder fsynced)."""
    data = json.dumps({"format": FORMAT, **doc}, indent=1, sort_keys=True, allow_nan=False).encode()
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
    folder = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(folder)  # the rename itself is on disk
    finally:
        os.close(folder)


class StateFile:
    """Writes `snapshot()` to the file after changes, one write at a time, off the event loop.
    Changes are counted; `durable()` waits until the count it saw is on disk."""

    def __init__(self, path: Path | None, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.path = path
        self._snapshot = snapshot
        self._asked = 0  # changes made so far
        self._taken = 0  # changes the newest write's snapshot holds
        self._written = 0  # changes on disk
        self._failed: tuple[int, str] | None = None  # the newest failed write: its count, why
        self._settled: asyncio.Condition | None = None  # told after each write
        self._writer: asyncio.Task[None] | None = None

    def changed(self) -> None:
        """Something in the state changed: write it soon (on the running loop)."""
        if self.path is None:
            return
        self._asked += 1
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # before the sidecar runs: Sidecar.start writes it
        if self._writer is None or self._writer.done():
            self._writer = loop.create_task(self._write())

    async def _write(self) -> None:
        assert self.path is not None
        loop = asyncio.get_running_loop()
        while self._taken < self._asked:
            count = self._taken = self._asked
            doc = self._snapshot()  # taken on the loop: a consistent view
            try:
                await loop.run_in_executor(None, write_atomically, self.path, doc)
            except asyncio.CancelledError:
                self._taken = self._written  # not known to be written: the next write takes it
                raise
            except (OSError, ValueError) as exc:
                why = f"state file {self.path}: cannot write it ({getattr(exc, 'strerror', None) or exc})"
                self._failed = (count, why)
                log.error("%s; the changes apply, and are written with the next change", why)
            else:
                self._written = count
            settled = self._condition()
            async with settled:
                settled.notify_all()

    def _condition(self) -> asyncio.Condition:
        if self._settled is None:
            self._settled = asyncio.Condition()
        return self._settled

    async def durable(self) -> None:
        """Once every change made so far is on disk; StateWriteError when the write that took
        them failed (and no later one succeeded)."""
        if self.path is None:
            return
        wanted = self._asked
        settled = self._condition()
        async with settled:
            while self._written < wanted:
                if self._failed is not None and self._failed[0] >= wanted:
                    raise StateWriteError(self._failed[1])
                if self._writer is None or self._writer.done():  # none running (one was cancelled)
                    self._taken = min(self._taken, self._written)
                    self._writer = asyncio.get_running_loop().create_task(self._write())
                await settled.wait()

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
