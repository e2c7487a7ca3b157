"""How many cores this process may use: the number behind `--workers auto`, the inference
threads and the inline-run limit.

os.cpu_count() is the host's: in a container with a CPU limit (Kubernetes `limits.cpu`, docker
`--cpus`) it can be many times what the process gets, and one worker or thread per host core then
oversubscribes the limit and multiplies memory (each worker holds its own sessions)."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def usable_cores(cgroup: Path = CGROUP) -> int:
    """The process's CPU affinity, capped by its cgroup's CPU quota (rounded up), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cpu_quota(cgroup)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def cpu_quota(cgroup: Path = CGROUP) -> float | None:
    """The cgroup's CPU limit in cores (cgroup v2 cpu.max, else v1 cpu.cfs_quota_us); None when
    there is none or it cannot be read."""
    try:
        quota, _, period = (cgroup / "cpu.max").read_text().partition(" ")
        if quota.strip() == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None
