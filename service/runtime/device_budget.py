"""Whether a version's CUDA sessions fit on their devices, judged before they load.

The loader (loader.py) reads each device's free memory from the driver (NVML, gpu_memory.py) just
before a CUDA version loads, and asks `plan_device_load` what to do: load; release a served
version of the same model first (`reload.when_over_budget: drain_first`, as for the model's own
memory budget); or refuse the version before any of its sessions takes the device, so that the
serving version keeps serving (`fail`). Here is only the arithmetic, on plain numbers.

What a session is held to need before it exists: the arena bound its config sets
(`execution.gpu_mem_limit_mb`: the session may grow to it, and its weights live in that arena),
else its weights (the version's files) plus DEVICE_RESERVE_BYTES for what its warm-up and first
runs allocate besides (activations, cuBLAS and cuDNN workspaces). With the process's run memory
bound (`--max-run-memory-mb`) the sessions allocate their weights with the device allocator
(`session.use_device_allocator_for_initializers`, session.py), outside the arena and its bound:
then the bound and the weights. Once loaded, what the version
really took is measured (the devices' used memory after its warm-up, less before its load) and is
what the model's memory budget counts from then on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

MIB = 1 << 20
# Kept free beyond a session's weights when its config sets no gpu_mem_limit_mb: its warm-up's
# activations and the CUDA libraries' workspaces (cuBLAS alone takes tens of MiB per stream).
DEVICE_RESERVE_BYTES = 256 * MIB


@dataclass(frozen=True)
class DeviceShortfall:
    device: int  # CUDA device id
    need: int  # bytes this version's sessions there are held to need
    free: int  # bytes free there now (NVML)


@dataclass(frozen=True)
class DevicePlan:
    action: Literal["load", "drain_first", "refuse"]
    short: tuple[DeviceShortfall, ...] = ()  # the devices without room (none when it loads)

    def reason(self) -> str:
        """Why it does not fit, for the version's status and the log."""
        return "; ".join(
            f"device {s.device} has {s.free / MIB:.0f} MiB free and the version needs {s.need / MIB:.0f} MiB"
            for s in self.short
        )


def session_need_bytes(
    weights_bytes: int,
    gpu_mem_limit_mb: int,
    reserve: int = DEVICE_RESERVE_BYTES,
    weights_in_arena: bool = True,
) -> int:
    """What one CUDA session is held to need on its device before it loads (see the module's doc)."""
    if not gpu_mem_limit_mb:
        return weights_bytes + reserve
    return gpu_mem_limit_mb * MIB + (0 if weights_in_arena else weights_bytes)


def plan_device_load(
    session_devices: Sequence[int],
    weights_bytes: int,
    gpu_mem_limit_mb: int,
    free: Mapping[int, int],
    when_over_budget: Literal["fail", "drain_first"],
    releasable: Mapping[int, int] | None = None,
    reserve: int = DEVICE_RESERVE_BYTES,
    weights_in_arena: bool = True,
) -> DevicePlan:
    """What to do with a CUDA version about to load: `session_devices` names the device of each
    of its sessions (a device twice: two instances there), `weights_bytes` one session's weights,
    `free` the free bytes of each device as the driver reports them now. A device `free` does not
    name (NVML does not see it) is not judged: its session's own creation will say.

    `releasable`: by device, what the served version that drain_first would release took there
    (measured after its warm-up). It is released only where that makes room: a version too large
    even then is refused with the served one still serving. `weights_in_arena`: False where the
    sessions' weights are allocated outside their arena (the process's run memory bound)."""
    per_session = session_need_bytes(weights_bytes, gpu_mem_limit_mb, reserve, weights_in_arena)
    needs = {
        device: count * per_session
        for device, count in sorted(Counter(session_devices).items())
        if device in free
    }
    short = tuple(DeviceShortfall(d, need, free[d]) for d, need in needs.items() if need > free[d])
    if not short:
        return DevicePlan("load")
    back = releasable or {}
    if (
        when_over_budget == "drain_first"
        and back
        and all(need <= free[d] + back.get(d, 0) for d, need in needs.items())
    ):
        return DevicePlan("drain_first", short)
    return DevicePlan("refuse", short)
