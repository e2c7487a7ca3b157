"""Command line: `python -m modelyard.gateway ...` (also `modelyard gateway ...`)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from modelyard.gateway.app import build_gateway
from modelyard.gateway.settings import ENV_PREFIX, parse_settings
from modelyard.process.lifecycle import run_process
from modelyard.process.logs import configure as configure_logging
from modelyard.process.startup import check_listeners


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(sys.argv[1:] if argv is None else argv)
    failed = check_listeners(settings, ("listen", "metrics_listen"), ENV_PREFIX, "modelyard gateway")
    if failed is not None:
        return failed
    configure_logging(settings.log_level, settings.log_format, "gateway")
    return asyncio.run(run_process(lambda: build_gateway(settings), "gateway", settings.grace_s))
