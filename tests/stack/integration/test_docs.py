"""The docs' commands exist: every link resolves, every `make` target is in the Makefile, every
`python -m` module is importable, and every `--flag` is one that one of our commands takes (read
from its own `--help`), so a renamed flag or a removed target fails here instead of in a reader's
terminal."""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.support import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
# Flags of other programs that the docs quote (Envoy, docker, kubectl, pip, curl).
FOREIGN_FLAGS = {"--mode", "--base-id", "--build-arg", "--cpus", "--help", "--target", "--drain-time-s"}
# Our commands: every flag the docs name must be in one of their `--help` texts. The benchmarks
# (each `make bench-*` runs one) are ours too.
COMMANDS = [
    "modelyard.cli",
    "modelyard.service",
    "modelyard.sidecar",
    "modelyard.gateway",
    "modelyard.deploy",
    "models.demo_models",
] + [
    f"bench.{script.stem}"
    for script in sorted((REPO_ROOT / "bench").glob("*.py"))
    if "__main__" in script.read_text() and script.stem not in {"bare_server", "echo_server"}
]


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def test_the_front_page_is_a_front_page() -> None:
    assert len(_text(REPO_ROOT / "README.md").splitlines()) <= 150


def test_every_link_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _text(page)):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.name}: {target}")
    assert not broken


def test_every_make_target_exists() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", makefile, re.MULTILINE))
    named = {t for page in PAGES for t in re.findall(r"\bmake ([a-z][a-z0-9-]*[a-z0-9])", _text(page))}
    assert named, "the docs name make targets"
    assert not named - targets


def _modules() -> set[str]:
    return {m for page in PAGES for m in re.findall(r"python -m ([a-z_][a-z0-9_.]*[a-z0-9_])", _text(page))}


def test_every_python_module_exists() -> None:
    missing = [m for m in sorted(_modules()) if importlib.util.find_spec(m) is None]
    assert not missing
    # The folders install under modelyard.* (the repository root on the path here would find the
    # bare folder names too, and each refuses to be imported so).
    folders = {"common", "service", "sidecar", "gateway", "deploy", "envoy"}
    bare = [m for m in _modules() if m.split(".")[0] in folders]
    assert not bare


@functools.cache
def _help(module: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"python -m {module} --help: {done.stderr[-500:]}"
    return done.stdout


def test_every_flag_is_one_of_our_commands_flags() -> None:
    modules = sorted(set(COMMANDS) | _modules())
    with ThreadPoolExecutor(max_workers=4) as pool:
        helps = dict(zip(modules, pool.map(_help, modules), strict=True))
    known = {flag for text in helps.values() for flag in re.findall(r"--[a-z][a-z0-9-]*", text)}
    named = {flag for page in PAGES for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", _text(page))}
    assert not named - known - FOREIGN_FLAGS
