"""`modelyard up` runs the sidecar only when its extra is installed: the sidecar package is in every
wheel, so an install with only the `service` extra has it but not pybreaker, and must not start it."""

from __future__ import annotations

import subprocess
import sys

from tests.support import REPO_ROOT

# An install without pybreaker, as a finder that refuses it (and checks the refusal is real).
PROBE = """
import sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "pybreaker" and sys.argv[1] == "refuse":
            raise ImportError("pybreaker is not installed here")
        return None

sys.meta_path.insert(0, Refuse())
from modelyard.deploy.up import sidecar_installed
try:
    import modelyard.sidecar.breakers
    importable = True
except ImportError:
    importable = False
print(sidecar_installed(), importable)
"""


def probe(mode: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_without_the_sidecar_extra_up_calls_the_service_directly() -> None:
    # The sidecar's modules are there but cannot import: the decision says so without importing them.
    assert probe("refuse") == ["False", "False"]


def test_with_the_sidecar_extra_up_runs_the_sidecar() -> None:
    assert probe("allow") == ["True", "True"]
