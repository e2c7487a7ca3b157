"""Fresh virtual environments, each holding the built wheel with one extra, installed from the
package registry as a user installs it: `python -m tests.installs [EXTRA ...]` (make test's
install step) makes them under .cache/installs/EXTRA, and tests/deploy/integration/test_installs.py runs
the service from them (making one itself where it is missing or stale, so a bare pytest works too,
paying the install once).

An environment is made anew when the extra's dependencies (in pyproject.toml) or the interpreter
change. Each test session then installs its own freshly built wheel into it without touching the
dependencies, so what runs there is this checkout's code. pip's own cache (when the registry lets
it keep one) makes a remake fast; on a clean machine the CPU extra takes ~25 s here, the CUDA extra
(~2.6 GB installed, most of it NVIDIA's libraries) ~80 s.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from tests import dockerfile

ROOT = dockerfile.ROOT
HOME = ROOT / ".cache" / "installs"
# service-cuda only where onnxruntime-gpu has wheels; elsewhere it would be the `service` extra.
CUDA_HERE = sys.platform == "linux" and platform.machine() == "x86_64"
EXTRAS = ("service-cpu", "service-cuda") if CUDA_HERE else ("service-cpu",)
INSTALL_TIMEOUT_S = 1800  # ~2 GB of NVIDIA wheels over a slow link


def clean_env() -> dict[str, str]:
    """The caller's environment less what would put this checkout (or its venv) on the path."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("MODELYARD_")}


def _run(cmd: list[str], timeout: float) -> None:
    done = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=timeout, check=False)
    ignored = "is ignored: it is neither a file nor a directory"  # this machine's pip config's noise
    errors = "\n".join(ln for ln in done.stderr.splitlines() if ignored not in ln)
    assert done.returncode == 0, f"{' '.join(cmd)}:\n{errors}"


def build_wheel(out: Path) -> Path:
    """The wheel, built from what deploy/Dockerfile's wheel stage copies (and nothing else)."""
    with tempfile.TemporaryDirectory() as scratch:
        dockerfile.copy_context("wheel", Path(scratch))
        command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        _run([*command, scratch, "-w", str(out)], timeout=300)
    (built,) = out.glob("modelyard-*.whl")
    return built


def requirements(extra: str) -> list[str]:
    """What `modelyard[extra]` asks of the registry: the base dependencies and the extra's, its
    self-references (`modelyard[...]`) followed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def of(name: str) -> list[str]:
        found = []
        for line in project["optional-dependencies"][name]:
            inner = re.fullmatch(r"modelyard\[([\w,-]+)\]", line)
            found += [r for e in inner.group(1).split(",") for r in of(e)] if inner else [line]
        return found

    return sorted({*project["dependencies"], *of(extra)})


def _stamp(extra: str) -> str:
    """Changes with what the environment's dependencies are, not with the rest of pyproject.toml."""
    text = "\n".join([extra, sys.version, sys.base_prefix, *requirements(extra)])
    return hashlib.sha256(text.encode()).hexdigest()


def environment(extra: str, wheel: Path) -> Path:
    """The environment of `extra` with `wheel` in it: made (from the registry) if it is missing or
    stale, else this wheel replaces the one there."""
    venv = HOME / extra
    python, marker = str(venv / "bin" / "python"), venv / ".installed"
    if marker.is_file() and marker.read_text().split()[0] == _stamp(extra):
        _run([python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], 300)
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    started = time.monotonic()
    _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    _run([python, "-m", "pip", "install", "-q", f"{wheel}[{extra}]"], timeout=INSTALL_TIMEOUT_S)
    took = time.monotonic() - started
    marker.write_text(f"{_stamp(extra)} {took:.0f}s\n")
    print(f"{extra}: a fresh environment in {venv}, installed in {took:.0f} s", file=sys.stderr)
    return venv


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.installs", description=__doc__)
    parser.add_argument("extras", nargs="*", metavar="EXTRA", help=f"of {', '.join(EXTRAS)} (default: all)")
    extras = parser.parse_args(argv).extras or EXTRAS
    if set(extras) - set(EXTRAS):
        parser.error(f"no environment for {', '.join(sorted(set(extras) - set(EXTRAS)))}")
    with tempfile.TemporaryDirectory() as out:
        wheel = build_wheel(Path(out))
        for extra in extras:
            environment(extra, wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
