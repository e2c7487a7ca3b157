"""Command line: `python -m modelyard.sidecar ...` (also `modelyard sidecar ...`)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from modelyard.process.lifecycle import run_process
from modelyard.process.logs import configure as configure_logging
from modelyard.process.startup import check_listeners
from modelyard.sidecar.config import ENV_PREFIX, parse_settings
from modelyard.sidecar.server import build_sidecar


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(sys.argv[1:] if argv is None else argv)
    failed = check_listeners(settings, ("listen", "admin_listen"), ENV_PREFIX, "modelyard sidecar")
    if failed is not None:
        return failed
    configure_logging(settings.log_level, settings.log_format, "sidecar")
    return asyncio.run(run_process(lambda: build_sidecar(settings), "sidecar", settings.grace_s))
