"""The sidecar's differential run (bench/sidecar_differential.py): this tree's sidecar and a base
tree's, in front of the same scripted upstream, give the same answers, headers, upstream calls,
spans, admin views and counters. It needs a second checkout, named by $SIDECAR_DIFFERENTIAL_BASE
(a source tree: e.g. `git worktree add --detach ../base <commit>` with the .venv linked);
without one it is skipped. Also a check of the script itself: a tree against itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BASE = os.environ.get("SIDECAR_DIFFERENTIAL_BASE", "")


def differential(base: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "bench.sidecar_differential", "--trees", f"base={base},now={ROOT}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.skipif(not BASE, reason="no base tree ($SIDECAR_DIFFERENTIAL_BASE)")
def test_the_sidecar_answers_as_the_base_tree_does() -> None:
    run = differential(BASE)
    assert run.returncode == 0 and "no difference" in run.stdout, run.stdout + run.stderr[-4000:]


def test_the_differential_run_finds_no_difference_between_a_tree_and_itself() -> None:
    run = differential(str(ROOT))
    assert run.returncode == 0 and "no difference" in run.stdout, run.stdout + run.stderr[-4000:]
