"""How many cores this process may use: moved to modelyard.process.cores (the sidecar's
`--workers auto` counts them too); kept here for the service's imports."""

from __future__ import annotations

from modelyard.process.cores import CGROUP, cpu_quota, usable_cores

__all__ = ["CGROUP", "cpu_quota", "usable_cores"]
