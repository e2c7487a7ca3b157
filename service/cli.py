"""Command line: `modelyard serve ...` (also `python -m service ...`)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from service.config import Settings, parse_settings
from service.logs import configure as configure_logging
from service.server import build_service

log = logging.getLogger("service")


async def serve(settings: Settings) -> int:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    service = build_service(settings)
    starting = loop.create_task(service.start())
    await asyncio.wait([starting, loop.create_task(stopping.wait())], return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        starting.result()  # a start-up failure ends the process with its error
        await stopping.wait()
    else:
        starting.cancel()
    log.info("shutting down: refusing new calls, %.1f s for in-flight calls to finish", settings.grace_s)
    await service.stop()
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "serve":  # `modelyard serve ...`; `python -m service ...` needs no verb
        args = args[1:]
    elif args and not args[0].startswith("-"):
        print(f"modelyard: unknown command {args[0]!r}; try `modelyard serve --help`", file=sys.stderr)
        return 2
    settings = parse_settings(args)
    configure_logging(settings.log_level, settings.log_format)
    return asyncio.run(serve(settings))
