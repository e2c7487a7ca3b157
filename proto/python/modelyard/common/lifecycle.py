"""A process's life: start, serve until SIGTERM or SIGINT, drain gracefully, exit with a code that
says how it ended. Every process (service, sidecar, gateway) runs through `run_process`."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Protocol

log = logging.getLogger(__name__)

EXIT_OK = 0  # stopped by a signal, drained cleanly
EXIT_FAILED = 1  # could not start, or failed while serving
EXIT_USAGE = 2  # bad flags or environment (argparse's code)


class Process(Protocol):
    """What run_process drives: `start` returns once serving; `stop` drains and releases."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def run_process(build: Callable[[], Process], name: str, grace_s: float) -> int:
    """Build and start the process, serve until a signal, then stop it. A failure while starting
    stops what did start and ends with EXIT_FAILED; a signal during start cancels the start."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        process = build()
    except Exception:
        log.exception("%s could not be built", name)
        return EXIT_FAILED
    code = EXIT_OK
    starting = loop.create_task(process.start())
    waiting = loop.create_task(stopping.wait())
    await asyncio.wait([starting, waiting], return_when=asyncio.FIRST_COMPLETED)
    if starting.done() and starting.exception() is not None:
        log.error("%s failed to start", name, exc_info=starting.exception())
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
