"""Command line: `python -m service ...` (also `modelyard serve ...`)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from modelyard.common.lifecycle import run_process
from modelyard.common.logs import configure as configure_logging

from service import tracing
from service.config import parse_settings
from service.server import build_service


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(sys.argv[1:] if argv is None else argv)
    configure_logging(settings.log_level, settings.log_format)
    tracing.configure()
    try:
        return asyncio.run(run_process(lambda: build_service(settings), "service", settings.grace_s))
    finally:
        tracing.shutdown()
