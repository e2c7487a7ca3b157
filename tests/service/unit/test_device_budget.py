"""Device memory in the version budget: the arithmetic and decision (device_budget.plan_device_load)
on plain numbers, the CUDA-to-NVML device numbering, and the loader refusing a CUDA version its
device has no room for before any session loads (the driver's numbers given as NVML gives them:
this machine has no GPU). The same on a real device is tests/service/integration/test_cuda.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from models import demo_models
from modelyard.service.gpu_memory import DeviceMemory, cuda_to_nvml, memory_of
from modelyard.service.repository.model_config import ModelConfig
from modelyard.service.runtime.device_budget import (
    DEVICE_RESERVE_BYTES,
    MIB,
    DevicePlan,
    DeviceShortfall,
    plan_device_load,
    session_need_bytes,
)
from modelyard.service.runtime.manager import ModelManager
from modelyard.service.runtime.providers import ProviderChoice
from modelyard.service.runtime.session import ModelRunner, load_runner
from modelyard.service.runtime.status import VersionState

GIB = 1 << 30
GPU = ProviderChoice(True, "test: CUDA usable")
NO_GPU = ProviderChoice(False, "test: no CUDA")


def test_a_session_needs_its_arena_bound_or_its_weights_and_the_reserve() -> None:
    assert session_need_bytes(100 * MIB, 0) == 100 * MIB + DEVICE_RESERVE_BYTES
    assert session_need_bytes(100 * MIB, 2048) == 2 * GIB  # the session may grow to its bound
    assert session_need_bytes(100 * MIB, 0, reserve=0) == 100 * MIB


def test_weights_outside_the_arena_add_to_its_bound() -> None:
    """With the process's run memory bound, sessions allocate their weights with the device
    allocator (session.use_device_allocator_for_initializers), not in the bounded arena."""
    assert session_need_bytes(100 * MIB, 2048, weights_in_arena=False) == 2 * GIB + 100 * MIB
    assert session_need_bytes(100 * MIB, 0, weights_in_arena=False) == 100 * MIB + DEVICE_RESERVE_BYTES
    room = {0: 2 * GIB + 50 * MIB}
    assert plan_device_load([0], 100 * MIB, 2048, room, "fail").action == "load"
    assert plan_device_load([0], 100 * MIB, 2048, room, "fail", weights_in_arena=False).action == "refuse"


def test_a_version_loads_where_every_device_has_room() -> None:
    free = {0: 10 * GIB, 1: 10 * GIB}
    assert plan_device_load([0, 1], 1 * GIB, 0, free, "fail") == DevicePlan("load")
    # Exactly what is needed is enough.
    need = 1 * GIB + DEVICE_RESERVE_BYTES
    assert plan_device_load([0], 1 * GIB, 0, {0: need}, "fail").action == "load"
    assert plan_device_load([0], 1 * GIB, 0, {0: need - 1}, "fail").action == "refuse"


def test_instances_on_one_device_add_up_there() -> None:
    free = {0: 5 * GIB, 1: 5 * GIB}
    # Two sessions of 2 GiB (gpu_mem_limit_mb) on device 0 need 4 GiB: they fit; three do not.
    assert plan_device_load([0, 0, 1], 0, 2048, free, "fail").action == "load"
    plan = plan_device_load([0, 0, 0, 1], 0, 2048, free, "fail")
    assert plan == DevicePlan("refuse", (DeviceShortfall(0, 6 * GIB, 5 * GIB),))
    assert plan.reason() == "device 0 has 5120 MiB free and the version needs 6144 MiB"


def test_a_device_nvml_does_not_see_is_not_judged() -> None:
    assert plan_device_load([3], 100 * GIB, 0, {0: 1 * GIB}, "fail").action == "load"


def test_drain_first_releases_the_served_version_only_where_that_makes_room() -> None:
    free = {0: 1 * GIB}
    # Version 1 took 3 GiB there: releasing it leaves 4 GiB, room for a 2 GiB version.
    plan = plan_device_load([0], 0, 2048, free, "drain_first", releasable={0: 3 * GIB})
    assert plan.action == "drain_first" and plan.short == (DeviceShortfall(0, 2 * GIB, 1 * GIB),)
    # A version too large even then is refused, and the served one keeps serving.
    assert plan_device_load([0], 0, 8192, free, "drain_first", releasable={0: 3 * GIB}).action == "refuse"
    # Nothing to release (no served version, or it was released already): refused.
    assert plan_device_load([0], 0, 2048, free, "drain_first").action == "refuse"
    # fail never releases.
    assert plan_device_load([0], 0, 2048, free, "fail", releasable={0: 3 * GIB}).action == "refuse"
    # Over two devices, the release must make room on each.
    two = {0: 1 * GIB, 1: 1 * GIB}
    assert plan_device_load([0, 1], 0, 2048, two, "drain_first", releasable={0: 3 * GIB}).action == "refuse"
    both = {0: 3 * GIB, 1: 3 * GIB}
    assert plan_device_load([0, 1], 0, 2048, two, "drain_first", releasable=both).action == "drain_first"


def test_cuda_device_ids_map_to_nvml_indices_through_cuda_visible_devices() -> None:
    assert cuda_to_nvml(1, visible="") == 1
    assert cuda_to_nvml(0, visible="2,0") == 2
    assert cuda_to_nvml(1, visible="2, 0") == 0
    assert cuda_to_nvml(2, visible="2,0") is None  # CUDA sees two devices
    assert cuda_to_nvml(0, visible="GPU-8e2c5b1a-0000-0000-0000-000000000000") is None


def test_memory_of_reads_the_devices_named_by_cuda_id(monkeypatch: pytest.MonkeyPatch) -> None:
    devices = [DeviceMemory(0, 1 * GIB, 80 * GIB), DeviceMemory(1, 7 * GIB, 80 * GIB)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert memory_of([0], lambda: devices) == {0: devices[1]}  # CUDA's 0 is NVML's 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert memory_of([0, 1, 5], lambda: devices) == {0: devices[0], 1: devices[1]}
    assert memory_of([0], lambda: None) is None  # no NVML


def on_the_cpu(model_file: Path, config: ModelConfig, providers: ProviderChoice) -> ModelRunner:
    """Sessions on the CPU (no GPU here), while the loader plans for CUDA."""
    return load_runner(model_file, config, NO_GPU)


@pytest.mark.parametrize("when", ["fail", "drain_first"])
async def test_a_cuda_version_without_room_on_its_device_is_refused_before_it_loads(
    tmp_path: Path, when: str
) -> None:
    root = tmp_path / "models"
    config = {"max_batch_size": 8, "reload": {"when_over_budget": when}}
    demo_models.write_model(root, "m", 1, demo_models.dense_stack(2, 64), config)
    used = [DeviceMemory(0, 79 * GIB, 80 * GIB)]  # 1 GiB free
    loads: list[int] = []

    def build(model_file: Path, config: ModelConfig, providers: ProviderChoice) -> ModelRunner:
        loads.append(int(model_file.parent.name))
        return on_the_cpu(model_file, config, providers)

    manager = ModelManager(root, GPU, loader=build, read_devices=lambda: used)
    try:
        await manager.load_all()
        assert manager.status("m").default_version == 1 and loads == [1]
        assert manager.resolve("m").device_bytes == {0: 0}  # read before and after: nothing grew
        # Version 2 bounds its sessions' arena at 2 GiB: more than the device's free 1 GiB.
        limited = {**config, "execution": {"gpu_mem_limit_mb": 2048}}
        demo_models.write_model(root, "m", 2, demo_models.dense_stack(2, 64, seed=2), limited)
        await manager.reconcile("m")
        failed = manager.status("m").versions[2]
        assert failed.state == VersionState.FAILED
        assert "device 0 has 1024 MiB free and the version needs 2048 MiB" in failed.reason
        assert loads == [1]  # refused before any session of it was made
        # Version 1 took nothing measurable on the device: releasing it makes no room, so even
        # drain_first keeps it serving.
        assert manager.status("m").versions[1].state == VersionState.READY
        assert manager.status("m").default_version == 1
    finally:
        await manager.close()


async def test_without_nvml_only_the_models_own_budget_applies(tmp_path: Path) -> None:
    root = tmp_path / "models"
    demo_models.write_model(
        root, "m", 1, demo_models.dense_stack(2, 64), {"execution": {"gpu_mem_limit_mb": 1 << 20}}
    )
    manager = ModelManager(root, GPU, loader=on_the_cpu, read_devices=lambda: None)
    try:
        await manager.load_all()
        assert manager.status("m").default_version == 1
        assert manager.resolve("m").device_bytes == {}
    finally:
        await manager.close()
