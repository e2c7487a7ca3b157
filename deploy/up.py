"""`make up`: the processes of one Modelyard host, started together and stopped together.

Each process is its own command line (as in production, one container each); this script only
starts them in order, forwards SIGINT/SIGTERM, and stops the rest when one exits. To add a
process (the gateway, Envoy), add an entry to `processes`.

    python deploy/up.py --repository models/demo
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

SERVICE = "127.0.0.1:50052"
SIDECAR = "127.0.0.1:50051"
SIDECAR_ADMIN = "127.0.0.1:9101"


def processes(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    python = sys.executable
    sidecar = [
        python,
        "-m",
        "sidecar",
        "--listen",
        SIDECAR,
        "--upstream",
        SERVICE,
        "--admin-listen",
        SIDECAR_ADMIN,
    ]
    if args.sidecar_config:
        sidecar += ["--config", args.sidecar_config]
    return [
        ("service", [python, "-m", "service", "--repository", args.repository, "--listen", SERVICE]),
        ("sidecar", sidecar),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start the service and its sidecar together.")
    parser.add_argument("--repository", default="models/demo")
    parser.add_argument("--sidecar-config", default="", help="the sidecar's route file (YAML)")
    args = parser.parse_args(argv)
    running: list[tuple[str, subprocess.Popen[bytes]]] = []
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    for name, command in processes(args):
        print(f"up: starting {name}: {' '.join(command[1:])}", file=sys.stderr)
        running.append((name, subprocess.Popen(command)))
    print(
        f"up: call the sidecar on {SIDECAR} (admin http://{SIDECAR_ADMIN}); Ctrl-C stops all", file=sys.stderr
    )
    code = 0
    while not stopping:
        ended = [(name, p.returncode) for name, p in running if p.poll() is not None]
        if ended:
            name, code = ended[0]
            print(f"up: {name} exited with {code}; stopping the others", file=sys.stderr)
            break
        time.sleep(0.2)
    for _, process in reversed(running):  # the front first: stop taking calls, then drain
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait()
    return code


if __name__ == "__main__":
    sys.exit(main())
