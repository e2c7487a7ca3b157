"""Command line: `python -m modelyard.deploy` (also `modelyard up`, `make up`)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from modelyard.deploy.up import parse_settings, run
from modelyard.process.logs import configure as configure_logging


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(sys.argv[1:] if argv is None else argv)
    configure_logging("INFO", "text", "up")
    return asyncio.run(run(settings))
