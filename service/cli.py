"""Command line: `python -m modelyard.service ...` (also `modelyard serve ...`)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Sequence

from modelyard.process import children
from modelyard.process.lifecycle import EXIT_USAGE, Process, run_process
from modelyard.process.logs import configure as configure_logging
from modelyard.process.startup import check_folder, check_listeners
from modelyard.service import tracing
from modelyard.service.runtime import runs
from modelyard.service.server import build_service
from modelyard.service.settings import ENV_PREFIX, Settings, parse_settings, worker_count
from modelyard.service.workers.member import WorkerRole
from modelyard.service.workers.supervisor import Supervisor


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(sys.argv[1:] if argv is None else argv)
    role = WorkerRole.from_environment()
    configure_logging(
        settings.log_level, settings.log_format, "service" if role is None else f"worker {role.index}"
    )
    # A worker's port is held by its supervisor, which checked it.
    failed = None if role is not None else _unstartable(settings)
    if failed is not None:
        return failed
    if role is not None:  # started by a supervisor: no worker outlives it
        children.die_with_parent(role.parent)
        return _traced(lambda: build_service(settings, worker=role), f"worker {role.index}", settings.grace_s)
    try:
        workers = worker_count(settings.workers)
    except ValueError as exc:
        print(f"modelyard serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if workers > 1:  # the supervisor serves no requests: its workers trace their own
        return asyncio.run(
            run_process(lambda: Supervisor(settings, workers), "service", settings.grace_s, PROG)
        )
    return _traced(lambda: build_service(settings), "service", settings.grace_s)


PROG = "modelyard serve"  # as its errors name it

# Where a service without --repository finds models (the wheel ships them as data, not in place).
_NO_MODELS = "; to try it, write the demo models with `modelyard demo-models DIR` and pass --repository DIR"


def _unstartable(settings: Settings) -> int | None:
    """EXIT_USAGE, after one line, for a start that cannot work: no repository, a taken port."""
    return check_folder(settings, "repository", ENV_PREFIX, PROG, _NO_MODELS) or check_listeners(
        settings, ("listen", "metrics_listen"), ENV_PREFIX, PROG
    )


def _traced(build: Callable[[], Process], name: str, grace_s: float) -> int:
    tracing.configure()
    try:
        code = asyncio.run(run_process(build, name, grace_s, PROG))
    finally:
        tracing.shutdown()
    if runs.abandoned.is_set():
        # A run that did not stop would hold the exit (its executor thread is joined): exit now.
        logging.shutdown()
        os._exit(code)
    return code
