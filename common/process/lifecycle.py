"""A process's life: start, serve until SIGTERM or SIGINT, drain gracefully, exit with a code that
says how it ended. Every process (service, sidecar, gateway) runs through `run_process`."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

log = logging.getLogger(__name__)

EXIT_OK = 0  # stopped by a signal, drained cleanly
EXIT_FAILED = 1  # could not start, or failed while serving
EXIT_USAGE = 2  # bad flags or environment (argparse's code), a taken port

T = TypeVar("T")


def usage_line(prog: str, prefix: str, name: str, message: str, hint: str = "") -> str:
    """The one line a setting's bad value gets, as modelyard.process.settings writes it."""
    flag = "--" + name.replace("_", "-")
    return f"{prog}: error: argument {flag}: {message} (env {prefix}{name.upper()}){hint}"


class BindError(Exception):
    """The listener of setting `name` (variable prefix `prefix`) could not bind `value`."""

    def __init__(self, prefix: str, name: str, value: str, reason: str) -> None:
        super().__init__(f"cannot listen on {value!r}: {reason}")
        self.prefix = prefix
        self.name = name

    def line(self, prog: str) -> str:
        return usage_line(prog, self.prefix, self.name, str(self))


def bound(prefix: str, name: str, value: str, bind: Callable[[], T]) -> T:
    """`bind()`, its failure (grpc's RuntimeError, an OSError) as a BindError naming the setting."""
    try:
        return bind()
    except (OSError, RuntimeError) as exc:
        raise BindError(prefix, name, value, bind_reason(exc)) from exc


def bind_reason(exc: Exception) -> str:
    """A failed bind's cause in words: the errno's text, or grpc's only news (no cause given)."""
    if isinstance(exc, OSError):
        return os.strerror(exc.errno).lower() if exc.errno else str(exc)
    return "the port is in use or the address is not this host's"


class Process(Protocol):
    """What run_process drives: `start` returns once serving; `stop` drains and releases."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def run_process(
    build: Callable[[], Process], name: str, grace_s: float, prog: str | None = None
) -> int:
    """Build and start the process, serve until a signal, then stop it. A failure while starting
    stops what did start and ends with EXIT_FAILED (EXIT_USAGE and one line for a BindError, as
    `prog` would say a bad value); a signal during start cancels the start."""
    prog = prog or f"modelyard {name}"
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        process = build()
    except BindError as exc:
        print(exc.line(prog), file=sys.stderr)
        return EXIT_USAGE
    except Exception:
        log.exception("%s could not be built", name)
        return EXIT_FAILED
    code = EXIT_OK
    starting = loop.create_task(process.start())
    waiting = loop.create_task(stopping.wait())
    await asyncio.wait([starting, waiting], return_when=asyncio.FIRST_COMPLETED)
    failure = starting.exception() if starting.done() else None
    if isinstance(failure, BindError):
        print(failure.line(prog), file=sys.stderr)
        code = EXIT_USAGE
    elif failure is not None:
        log.error("%s failed to start", name, exc_info=failure)
        code = EXIT_FAILED
    elif starting.done():
        await waiting
    else:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
    waiting.cancel()
    log.info("shutting down: refusing new calls, %.1f s for in-flight calls to finish", grace_s)
    if not await _stopped(process.stop(), name):
        code = EXIT_FAILED
    log.info("stopped")
    return code


async def _stopped(stopping: Awaitable[None], name: str) -> bool:
    try:
        await stopping
        return True
    except Exception:
        log.exception("%s did not stop cleanly", name)
        return False
