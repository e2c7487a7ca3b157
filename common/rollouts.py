"""`python -m modelyard.rollouts ...`: the fleet rollout controller (modelyard.sidecar.fleet), as
`modelyard rollouts ...` runs it. Only the command line: this package imports no process."""

from __future__ import annotations

import sys

from modelyard.cli import main

if __name__ == "__main__":
    sys.exit(main(["rollouts", *sys.argv[1:]]))
