"""Command line: `python -m service ...` (also `modelyard serve ...`)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Sequence

from modelyard.common import children
from modelyard.common.lifecycle import EXIT_USAGE, Process, run_process
from modelyard.common.logs import configure as configure_logging

from service import tracing
from service.config import parse_settings, worker_count
from service.runtime import runs
from service.server import build_service
from service.workers.member import WorkerRole
from service.workers.supervisor import Supervisor


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(sys.argv[1:] if argv is None else argv)
    configure_logging(settings.log_level, settings.log_format)
    role = WorkerRole.from_environment()
    if role is not None:  # started by a supervisor: no worker outlives it
        children.die_with_parent(role.parent)
        return _traced(lambda: build_service(settings, worker=role), f"worker {role.index}", settings.grace_s)
    try:
        workers = worker_count(settings.workers)
    except ValueError as exc:
        print(f"modelyard serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if workers > 1:  # the supervisor serves no requests: its workers trace their own
        return asyncio.run(run_process(lambda: Supervisor(settings, workers), "service", settings.grace_s))
    return _traced(lambda: build_service(settings), "service", settings.grace_s)


def _traced(build: Callable[[], Process], name: str, grace_s: float) -> int:
    tracing.configure()
    try:
        code = asyncio.run(run_process(build, name, grace_s))
    finally:
        tracing.shutdown()
    if runs.abandoned.is_set():
        # A run that did not stop would hold the exit (its executor thread is joined): exit now.
        logging.shutdown()
        os._exit(code)
    return code
