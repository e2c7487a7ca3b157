"""Command line: `python -m modelyard.sidecar ...` (also `modelyard sidecar ...`)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from modelyard.process import children
from modelyard.process.lifecycle import EXIT_USAGE, run_process
from modelyard.process.logs import configure as configure_logging
from modelyard.process.startup import check_listeners, usage_error
from modelyard.process.workers import worker_count
from modelyard.sidecar.routes.saved import read_saved
from modelyard.sidecar.routes.state_file import StateError
from modelyard.sidecar.server import build_sidecar
from modelyard.sidecar.settings import ENV_PREFIX, parse_settings
from modelyard.sidecar.workers.role import WorkerRole
from modelyard.sidecar.workers.supervisor import Supervisor

PROG = "modelyard sidecar"


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(sys.argv[1:] if argv is None else argv)
    role = WorkerRole.from_environment()
    if role is not None:  # started by a supervisor, which holds the port: no worker outlives it
        configure_logging(settings.log_level, settings.log_format, f"sidecar worker {role.index}")
        children.die_with_parent(role.parent)
        name = f"sidecar worker {role.index}"
        return asyncio.run(
            run_process(
                lambda: build_sidecar(settings, worker=role, settle_heap=True), name, settings.grace_s
            )
        )
    try:
        workers = worker_count(settings.workers)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if workers > 1 and settings.state_file:
        # Every worker would write the one file; not supported yet (docs/sidecar.md).
        print(f"{PROG}: error: --state-file cannot be used with --workers above 1 yet", file=sys.stderr)
        return EXIT_USAGE
    failed = check_listeners(settings, ("listen", "admin_listen"), ENV_PREFIX, PROG)
    if failed is not None:
        return failed
    if settings.state_file:
        # A state file the sidecar cannot use is the operator's to fix: one line, as a bad flag.
        try:
            read_saved(Path(settings.state_file))
        except StateError as exc:
            return usage_error(PROG, ENV_PREFIX, "state_file", str(exc))
    configure_logging(settings.log_level, settings.log_format, "sidecar")
    if workers > 1:
        return asyncio.run(
            run_process(lambda: Supervisor(settings, workers), "sidecar", settings.grace_s, PROG)
        )
    return asyncio.run(
        run_process(lambda: build_sidecar(settings, settle_heap=True), "sidecar", settings.grace_s)
    )
