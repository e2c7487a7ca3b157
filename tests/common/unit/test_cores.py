"""`--workers auto` and the thread defaults count the cores the process may use: its affinity,
capped by its container's CPU limit (cgroup v2 cpu.max, v1 cfs quota)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modelyard.process.cores import cpu_quota, usable_cores
from modelyard.service.settings import worker_count

AFFINITY = len(os.sched_getaffinity(0))


def v2(root: Path, text: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpu.max").write_text(text)
    return root


def v1(root: Path, quota: int, period: int) -> Path:
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return root


def test_a_v2_limit_caps_the_cores_rounding_up(tmp_path: Path) -> None:
    assert cpu_quota(v2(tmp_path, "150000 100000\n")) == 1.5
    assert usable_cores(tmp_path) == min(AFFINITY, 2)


def test_a_limit_below_one_core_still_gives_one(tmp_path: Path) -> None:
    assert usable_cores(v2(tmp_path, "20000 100000\n")) == 1


def test_no_limit_leaves_the_affinity(tmp_path: Path) -> None:
    assert cpu_quota(v2(tmp_path, "max 100000\n")) is None
    assert usable_cores(tmp_path) == AFFINITY
    assert usable_cores(tmp_path / "absent") == AFFINITY


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    assert cpu_quota(v1(tmp_path, 100000, 100000)) == 1.0
    assert usable_cores(tmp_path) == 1
    assert cpu_quota(v1(tmp_path / "unlimited", -1, 100000)) is None


def test_an_unreadable_file_means_no_limit(tmp_path: Path) -> None:
    assert cpu_quota(v2(tmp_path, "garbage")) is None


def test_workers_auto_counts_usable_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert worker_count("auto") == 1
    assert worker_count(" AUTO ") == 1
