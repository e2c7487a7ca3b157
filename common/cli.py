"""The `modelyard` command: `modelyard serve|sidecar|gateway ...` runs that process's own command
line (the same as `python -m modelyard.{service,sidecar,gateway} ...`); `modelyard canary ...`
talks to a sidecar's admin endpoint (weights and rollouts: modelyard.sidecar.rollout.canary_cli), or with
`--controller URL` to the fleet rollout controller that `modelyard rollouts ...` runs
(modelyard.sidecar.fleet; also `python -m modelyard.rollouts`).

The process package is imported by name when its verb is used, so a sidecar host runs `modelyard
sidecar` without the service's dependencies installed, and this package imports no process.
`modelyard demo-models DIR` writes the demo model repository (shipped in the wheel) into DIR;
`modelyard --version` prints the installed version.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Sequence
from pathlib import Path

from modelyard.process.lifecycle import EXIT_USAGE
from modelyard.process.logs import quiet_grpc_core

# verb -> the process package whose cli.main takes the rest of the arguments.
COMMANDS = {
    "serve": "service",
    "sidecar": "sidecar",
    "gateway": "gateway",
    "up": "deploy",
    "canary": "sidecar",
    "rollouts": "sidecar",
}
# verbs whose module is not the package's cli (the admin clients need none of the process's code)
MODULES = {"canary": "modelyard.sidecar.rollout.canary_cli", "rollouts": "modelyard.sidecar.fleet.cli"}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        verbs = ",".join([*COMMANDS, "demo-models"])
        # Asked for: stdout and 0; no verb at all: a usage error.
        print(
            f"usage: modelyard {{{verbs}}} [--help | options] | --version",
            file=sys.stdout if args else sys.stderr,
        )
        return 0 if args else EXIT_USAGE
    if args[0] == "--version":
        print(f"modelyard {importlib.metadata.version('modelyard')}")
        return 0
    if args[0] == "demo-models":
        return demo_models(args[1:])
    package = COMMANDS.get(args[0])
    if package is None:
        print(f"modelyard: unknown command {args[0]!r}; try `modelyard --help`", file=sys.stderr)
        return EXIT_USAGE
    quiet_grpc_core()  # before the process imports grpc
    try:
        module = importlib.import_module(MODULES.get(args[0], f"modelyard.{package}.cli"))
    except ImportError as exc:
        print(
            f"modelyard {args[0]}: {exc}; install it with pip install 'modelyard[{package}]'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    code: int = module.main(args[1:])
    return code


def demo_models(args: Sequence[str]) -> int:
    """`modelyard demo-models DIR`: the demo repository, to serve with `--repository DIR`."""
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: modelyard demo-models DIR (writes the demo models into DIR)", file=sys.stderr)
        return 0 if list(args) in (["-h"], ["--help"]) else EXIT_USAGE
    from modelyard import demo  # data only: no process, no ONNX Runtime

    try:
        names = demo.copy_to(Path(args[0]))
    except OSError as exc:
        print(f"modelyard demo-models: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {', '.join(names)} to {args[0]}; serve them with: modelyard serve --repository {args[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
