"""Child processes, handled one way by every parent (the service's worker supervisor, `python -m
modelyard.deploy`, the tests, the benchmarks): started, optionally in their own session and told to die with
their parent; their ready line read from their output; stopped for sure (a signal, a bounded wait,
then SIGKILL). Sync (subprocess.Popen) and asyncio flavours of the same few steps."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

PR_SET_PDEATHSIG = 1  # linux/prctl.h


@functools.cache
def _prctl() -> Any:
    """libc's prctl, or None off Linux. Resolved in the parent: a child between fork and exec
    should not load libraries (another thread may have held the loader's lock at the fork)."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    except OSError:
        return None


def die_with_parent(parent: int | None = None, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux), so that no child
    outlives its parent; if the parent is already gone, send it now. `parent` is the pid the
    parent had, where known; without it, a parent pid of 1 (init adopted us) means gone.
    Called by the child itself (a worker, first thing) or between fork and exec (`with_parent`)."""
    prctl = _prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, sig)
    gone = os.getppid() != parent if parent is not None else os.getppid() == 1
    if gone:  # it died before the prctl: nothing will send the signal
        os.kill(os.getpid(), sig)


@functools.cache
def _setpriv() -> str | None:
    found = shutil.which("setpriv")  # util-linux
    return os.path.realpath(found) if found is not None else None


SETPRIV_WAIT_S = 5.0


def _still_setpriv(pid: int) -> bool:
    """The child is still setpriv, before its prctl and exec (not yet told to die with us)."""
    try:
        return os.readlink(f"/proc/{pid}/exe") == _setpriv()
    except OSError:  # gone already, or no /proc
        return False


def _session(cmd: Sequence[str], own_session: bool, with_parent: bool) -> tuple[list[str], dict[str, Any]]:
    """The command to run and Popen's options for it."""
    options: dict[str, Any] = {}
    if own_session:
        # A Ctrl-C in the terminal reaches only the parent, which stops its children in order.
        options["start_new_session"] = True
    if with_parent:
        setpriv = _setpriv()
        if setpriv is not None:
            # setpriv asks for the signal and execs the command (same pid; the setting survives
            # the exec). Not a preexec_fn: that makes Python fork() and run code in the child
            # before the exec, and a child forked while this process's gRPC threads are busy
            # can crash there (grpc/grpc#43055: seen in the benchmarks, 8 of 40 forks).
            return [setpriv, "--pdeathsig", "TERM", "--", *cmd], options
        _prctl()
        options["preexec_fn"] = functools.partial(die_with_parent, os.getpid())
    return list(cmd), options


def popen(
    cmd: Sequence[str], *, own_session: bool = False, with_parent: bool = False, **options: Any
) -> subprocess.Popen[Any]:
    """subprocess.Popen(cmd, **options), in its own session and/or dying with this process."""
    argv, extra = _session(cmd, own_session, with_parent)
    proc = subprocess.Popen(argv, **extra, **options)
    if with_parent and argv[0] == _setpriv():  # back once setpriv has asked for the signal
        deadline = time.monotonic() + SETPRIV_WAIT_S
        while _still_setpriv(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.0005)
    return proc


async def create(
    cmd: Sequence[str], *, own_session: bool = False, with_parent: bool = False, **options: Any
) -> asyncio.subprocess.Process:
    """asyncio.create_subprocess_exec(*cmd, **options), with the same choices as `popen`."""
    (program, *args), extra = _session(cmd, own_session, with_parent)
    proc = await asyncio.create_subprocess_exec(program, *args, **extra, **options)
    if with_parent and program == _setpriv():  # back once setpriv has asked for the signal
        deadline = time.monotonic() + SETPRIV_WAIT_S
        while _still_setpriv(proc.pid) and time.monotonic() < deadline:  # noqa: ASYNC110 (a /proc state: no event to wait on)
            await asyncio.sleep(0.0005)
    return proc


def stop(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, grace_s: float = 10.0) -> bool:
    """Stop it for sure: `sig` if it still runs, up to `grace_s` to exit, then SIGKILL. True when
    it exited by itself within the grace period (or had already), False when it was killed."""
    if proc.poll() is None:  # a reaped child is not signalled: its pid may be another's now
        proc.send_signal(sig)
    try:
        proc.wait(grace_s)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def send(proc: asyncio.subprocess.Process, sig: int) -> bool:
    """`sig` to the process if it still runs; True when sent."""
    if proc.returncode is not None:
        return False
    with contextlib.suppress(ProcessLookupError):  # exited, not yet reaped
        proc.send_signal(sig)
        return True
    return False


async def stop_async(
    proc: asyncio.subprocess.Process, sig: int = signal.SIGTERM, grace_s: float = 10.0
) -> bool:
    """`stop` for an asyncio child."""
    if proc.returncode is not None:
        return True
    send(proc, sig)
    try:
        await asyncio.wait_for(proc.wait(), grace_s)
        return True
    except TimeoutError:
        send(proc, signal.SIGKILL)
        await proc.wait()
        return False


@dataclass
class ReadyLine:
    """A child's output, line by line (line ends stripped): each line goes to `on_line`; the first
    that matches `pattern` is kept in `match` (a process is ready when it logs its address)."""

    pattern: re.Pattern[str] | None
    on_line: Callable[[str], None] | None = None
    match: re.Match[str] | None = None

    def feed(self, line: str) -> bool:
        """One line; True when it is the ready line."""
        if self.on_line is not None:
            self.on_line(line)
        if self.match is None and self.pattern is not None:
            self.match = self.pattern.search(line)
            return self.match is not None
        return False


def follow(stream: IO[str], lines: ReadyLine) -> threading.Event:
    """Read `stream` to its end on a daemon thread (so that the child never blocks on a full pipe).
    The event is set at the ready line, or at the end of the output (the child exited)."""
    found = threading.Event()

    def pump() -> None:
        for line in stream:
            if lines.feed(line.rstrip()):
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    return found


async def follow_async(stream: asyncio.StreamReader, lines: ReadyLine, ready: asyncio.Event) -> None:
    """Read `stream` to its end; `ready` is set at the ready line."""
    async for raw in stream:
        if lines.feed(raw.decode(errors="replace").rstrip()):
            ready.set()


async def wait_ready(proc: asyncio.subprocess.Process, ready: asyncio.Event, timeout_s: float) -> bool:
    """Until `ready` is set (True), or the process exits or `timeout_s` passes first (False)."""
    exited = asyncio.ensure_future(proc.wait())
    waiting = asyncio.ensure_future(ready.wait())
    try:
        done, _ = await asyncio.wait(
            {exited, waiting}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        exited.cancel()
        waiting.cancel()
    return waiting in done
