"""What /proc says of the processes a benchmark measures: CPU time of a process tree, memory."""

from __future__ import annotations

import os
from pathlib import Path

from bench.processes import CLK_TCK


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and all its descendants now alive (from /proc)."""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    pending.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def rss_kib(pid: int) -> int:
    """Resident memory of a process (VmRSS), KiB; 0 when /proc does not say."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0
