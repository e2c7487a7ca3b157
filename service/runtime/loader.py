"""The loader: builds a version's sessions (checked, loaded and warmed up on every instance,
within the model's memory budget and, on CUDA, the room its devices have) and releases them once
the version's requests have drained.

On CUDA the devices' memory is read from the driver (NVML): free memory before a load, judged by
device_budget.plan_device_load before any session takes the device; the devices' use after the
warm-up, less before the load, as what the version took (the model's memory budget counts that);
and again after a retired version's sessions are released, as what came back (logged).

It works for the reconciler, which decides what to load and when; what serves is the served
table's, and what the versions' states are is the status board's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from pathlib import Path
from types import MappingProxyType

from modelyard.service.errors import ModelLoadError
from modelyard.service.gpu_memory import DeviceMemory, memory_of, read_nvml
from modelyard.service.metrics import ServiceMetrics
from modelyard.service.repository.checksum import verify_checksum
from modelyard.service.repository.files import check_tree_inside
from modelyard.service.repository.labels import load_labels
from modelyard.service.repository.model_config import ModelConfig
from modelyard.service.repository.scanner import version_bytes
from modelyard.service.runtime.device_budget import MIB, plan_device_load
from modelyard.service.runtime.instances import Loader, load_instances, placements
from modelyard.service.runtime.memory import trim_heap
from modelyard.service.runtime.providers import ProviderChoice
from modelyard.service.runtime.runs import ActiveRuns
from modelyard.service.runtime.served import ServedModel, ServedVersion
from modelyard.service.runtime.session import ModelRunner, bound_run_memory
from modelyard.service.runtime.signature import Signature
from modelyard.service.runtime.status import StatusBoard, VersionState, VersionStatus
from modelyard.service.runtime.table import ServedTable

log = logging.getLogger(__name__)

# A layer above (batching) attaching to a version that just loaded, before it serves; it lets go
# through ServedVersion.on_retire.
LoadHook = Callable[[ServedVersion], None]
# The version of a model whose platform is no ONNX Runtime session (an ensemble: its steps run
# other models), built by the layer that runs it: (name, number, version folder's model file
# path, config, fingerprint) -> the version, or ModelLoadError.
PlatformLoad = Callable[[str, int, Path, ModelConfig, tuple[object, ...]], Awaitable[ServedVersion]]
ONNX_PLATFORM = "onnxruntime_onnx"


class VersionLoader:
    def __init__(
        self,
        table: ServedTable,
        board: StatusBoard,
        providers: ProviderChoice,
        metrics: ServiceMetrics,
        io: Executor,  # the one model-io thread: loads, file reads and releases
        runs: ActiveRuns,
        drain_timeout_s: float,
        build: Loader,  # one instance's session (test seam: one that fails or blocks on demand)
        read_devices: Callable[[], list[DeviceMemory] | None] = read_nvml,  # the driver's view
    ) -> None:
        self._table = table
        self._board = board
        self.providers = providers
        self._metrics = metrics
        self._io = io
        self._runs = runs
        self.drain_timeout_s = drain_timeout_s
        self._build = build
        self._read_devices = read_devices
        self._load_hooks: list[LoadHook] = []
        self._retiring: set[asyncio.Task[None]] = set()
        self._platforms: dict[str, PlatformLoad] = {}

    def on_load(self, hook: LoadHook) -> None:
        """Call `hook` with every version that loads from now on, before it serves a request."""
        self._load_hooks.append(hook)

    def add_platform(self, platform: str, load: PlatformLoad) -> None:
        """Load the versions of models of `platform` (config.yaml's platform) with `load`."""
        self._platforms[platform] = load

    async def _load_platform(
        self, name: str, number: int, model_file: Path, config: ModelConfig, print_: tuple[object, ...]
    ) -> ServedVersion:
        """A version that is no session of ours: its platform's layer builds it."""
        started = time.perf_counter()
        try:
            load = self._platforms.get(config.platform)
            if load is None:
                raise ModelLoadError(f"platform {config.platform!r} is not served here", "config")
            served = await load(name, number, model_file, config, print_)
        except ModelLoadError as exc:
            log.error("model %s version %d failed to load: %s", name, number, exc)
            self._metrics.load_failures.labels(name, exc.kind).inc()
            self._metrics.model_loads.labels(name, "failed").inc()
            raise
        self._metrics.model_loads.labels(name, "ready").inc()
        self._metrics.load_seconds.labels(name).observe(time.perf_counter() - started)
        log.info("model %s version %d loaded (%s)", name, number, config.platform)
        for attach in self._load_hooks:
            attach(served)
        return served

    @property
    def retiring(self) -> int:
        """Versions out of the table whose release has not finished yet."""
        return len(self._retiring)

    async def load(
        self,
        name: str,
        number: int,
        model_file: Path,
        config: ModelConfig,
        print_: tuple[object, ...],
        reference: tuple[int, Signature] | None,
        current: dict[int, ServedVersion],
    ) -> ServedVersion:
        """Validate and load one version; ModelLoadError (logged and counted) if it cannot."""
        if config.platform != ONNX_PLATFORM:
            return await self._load_platform(name, number, model_file, config, print_)
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            # Every instance holds its own copy of the model.
            sessions = len(placements(config, self.providers))
            weights = await loop.run_in_executor(self._io, version_bytes, model_file)
            memory = weights * sessions
            await self._make_room(name, number, memory, config, current)
            devices = self._cuda_devices(config)
            if devices:
                await self._make_device_room(name, number, devices, weights, config, current)
            root = model_file.parent.parent.parent  # <root>/<model>/<version>/model.onnx
            await loop.run_in_executor(self._io, check_tree_inside, root, model_file.parent)
            await loop.run_in_executor(self._io, verify_checksum, model_file, root)
            # All instances load (and warm up) before the version serves, or none does.
            runners, device_bytes = await loop.run_in_executor(
                self._io, self._load_measured, model_file, config, devices
            )
            runner = runners[0]
            labels = await loop.run_in_executor(self._io, load_labels, model_file.parent.parent, config)
            if reference is not None and not config.reload.allow_schema_change:
                _check_compatible(runner.signature, reference, model_file)
        except ModelLoadError as exc:
            log.error("model %s version %d failed to load: %s", name, number, exc)
            self._metrics.load_failures.labels(name, exc.kind).inc()
            self._metrics.model_loads.labels(name, "failed").inc()
            raise
        elapsed = time.perf_counter() - started
        self._metrics.model_loads.labels(name, "ready").inc()
        self._metrics.load_seconds.labels(name).observe(elapsed)
        # What the model's memory budget counts: on a device, what its sessions really took.
        took = sum(device_bytes.values())
        served = ServedVersion(name, number, runners, config, print_, max(memory, took), self._runs)
        served.device_bytes = device_bytes
        log.info(
            "model %s version %d loaded on %s in %.0f ms (warm-up run %.0f us, %s; %d instance%s: %s)",
            name,
            number,
            runner.provider,
            elapsed * 1e3,
            runner.warmup_run_s * 1e6,
            "inline"
            if served.instances.runs_inline
            else f"executor: {runner.value_driven or 'several instances, or a slow largest batch'}",
            len(runners),
            "" if len(runners) == 1 else "s",
            ", ".join(r.device for r in runners),
        )
        if devices:
            log.info(
                "model %s version %d took %.0f MiB of device memory (its sessions after warm-up, by NVML)",
                name,
                number,
                took / MIB,
            )
        served.labels = labels
        self._metrics.instances.add(name, str(number), served.instances)
        for attach in self._load_hooks:
            attach(served)
        return served

    async def _make_room(
        self, name: str, number: int, need: int, config: ModelConfig, current: dict[int, ServedVersion]
    ) -> None:
        """Check the model's memory budget before loading; free room first if the config allows."""
        budget = config.reload.memory_budget_mb * 1024 * 1024
        served = self._table.get(name)
        in_use = sum(v.memory_bytes for v in served.versions.values()) if served else 0
        if not budget or in_use + need <= budget:
            return
        mb = 1024 * 1024
        if config.reload.when_over_budget == "fail" or served is None:
            raise ModelLoadError(
                f"version {number} needs {need / mb:.1f} MB beside the {in_use / mb:.1f} MB served; "
                f"the memory budget is {budget / mb:.1f} MB (reload.when_over_budget: fail)",
                "memory",
            )
        victim = await self._drain_one(name, number, served, current, "memory budget")
        if in_use - victim.memory_bytes + need > budget:
            raise ModelLoadError(
                f"version {number} needs {need / mb:.1f} MB; the memory budget is {budget / mb:.1f} MB",
                "memory",
            )

    async def _drain_one(
        self, name: str, number: int, served: ServedModel, current: dict[int, ServedVersion], why: str
    ) -> ServedVersion:
        """drain_first: release the version this one replaces (or the oldest), before loading."""
        victim = _victim(served, number)
        log.warning(
            "model %s: releasing version %d before loading version %d (%s)", name, victim.version, number, why
        )
        rest = {n: v for n, v in served.versions.items() if v is not victim}
        self._board.start_reloading(name)
        self._table.swap(name, ServedModel(name, served.config, MappingProxyType(rest)) if rest else None)
        current.pop(victim.version, None)
        await self.retire(victim)
        return victim

    def _cuda_devices(self, config: ModelConfig) -> list[int]:
        """The CUDA device of each session a version of `config` loads; [] where it runs on the CPU."""
        if config.execution.provider == "cpu" or not self.providers.cuda_usable:
            return []
        return [p.device_id for p in placements(config, self.providers)]

    async def _make_device_room(
        self,
        name: str,
        number: int,
        devices: Sequence[int],
        weights: int,
        config: ModelConfig,
        current: dict[int, ServedVersion],
    ) -> None:
        """Refuse a CUDA version its devices have no room for before it takes them, or release a
        served version of the model first (reload.when_over_budget: drain_first) and judge again
        on what the devices then report."""
        loop = asyncio.get_running_loop()
        drained: ServedVersion | None = None
        while True:
            memory = await loop.run_in_executor(self._io, memory_of, set(devices), self._read_devices)
            if memory is None:  # no NVML: only the model's own memory budget applies
                return
            served = self._table.get(name)
            victim = _victim(served, number) if served is not None and drained is None else None
            plan = plan_device_load(
                devices,
                weights,
                config.execution.gpu_mem_limit_mb,
                {device: m.total - m.used for device, m in memory.items()},
                config.reload.when_over_budget,
                releasable=victim.device_bytes if victim is not None else None,
                # With the run memory bound, weights go outside the arena (session.py).
                weights_in_arena=not bound_run_memory(0),
            )
            if plan.action == "load":
                return
            if plan.action == "refuse" or served is None:
                after = f" after releasing version {drained.version}" if drained is not None else ""
                raise ModelLoadError(
                    f"version {number} does not fit on its device{after}: {plan.reason()} "
                    f"(reload.when_over_budget: {config.reload.when_over_budget})",
                    "memory",
                )
            drained = await self._drain_one(name, number, served, current, "device memory")

    def _load_measured(
        self, model_file: Path, config: ModelConfig, devices: Sequence[int]
    ) -> tuple[list[ModelRunner], dict[int, int]]:
        """Load every instance (on the model-io thread, which does one load at a time) and what
        their devices' used memory grew by, from before the load to after the warm-ups (0 off a
        device or without NVML)."""
        before = memory_of(set(devices), self._read_devices) if devices else None
        runners = load_instances(self._build, model_file, config, self.providers)
        after = memory_of(set(devices), self._read_devices) if before is not None else None
        return runners, _grown(before, after)

    def retire_later(self, served: ServedVersion, replaced: bool) -> None:
        """Retire `served` in a task of its own (`wait_retired` waits for them all)."""
        task = asyncio.get_running_loop().create_task(self.retire(served, replaced))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def wait_retired(self) -> None:
        if self._retiring:
            await asyncio.gather(*self._retiring)

    async def retire(self, served: ServedVersion, replaced: bool = False) -> None:
        """Wait for the version's in-flight requests, then drop the table's reference to its
        session (ONNX Runtime frees a session's memory only when the session object is destroyed)."""
        name, number = served.model, served.version
        if not replaced:
            self._board.set_version(name, VersionStatus(number, VersionState.DRAINING, time.time()))
        started = time.perf_counter()
        drained = await served.drain(self.drain_timeout_s)
        if self._board.knows(name):  # a model that left the repository has no series any more
            self._metrics.drain_seconds.labels(name).observe(time.perf_counter() - started)
        if not drained:
            log.warning(
                "model %s version %d released with %d requests still running after %.1f s drain",
                name,
                number,
                served.in_flight,
                self.drain_timeout_s,
            )
        await served.stop_workers()
        # Its series leave with it, and the metrics let go of its sessions.
        self._metrics.instances.remove(name, str(number), served.instances)
        loop = asyncio.get_running_loop()
        devices = _devices_of(served)
        before = (
            await loop.run_in_executor(self._io, memory_of, devices, self._read_devices) if devices else None
        )
        served.drop_session()
        await loop.run_in_executor(self._io, trim_heap)
        if before is not None:
            after = await loop.run_in_executor(self._io, memory_of, devices, self._read_devices)
            log.info(
                "model %s version %d gave back %.0f MiB of device memory (it took %.0f MiB)",
                name,
                number,
                sum(_grown(after, before).values()) / MIB,
                sum(served.device_bytes.values()) / MIB,
            )
        if not replaced and self._board.knows(name):
            self._board.set_version(name, VersionStatus(number, VersionState.UNLOADED, time.time()))
        log.info("model %s version %d released", name, number)


def _grown(before: dict[int, DeviceMemory] | None, after: dict[int, DeviceMemory] | None) -> dict[int, int]:
    """By device read both times, how much its used memory grew (never below 0)."""
    if before is None or after is None:
        return {}
    return {d: max(0, after[d].used - before[d].used) for d in sorted(before.keys() & after.keys())}


def _victim(served: ServedModel, number: int) -> ServedVersion:
    """The version drain_first releases: the one the new version replaces, or the oldest."""
    return served.versions.get(number) or served.versions[min(served.versions)]


def _devices_of(served: ServedVersion) -> set[int]:
    """The CUDA devices the version's instances run on."""
    return {int(i.device.split(":")[1]) for i in served.instances.all if i.device.startswith("cuda:")}


def _check_compatible(new: Signature, reference: tuple[int, Signature], model_file: Path) -> None:
    """A new version must take and give the tensors the served one does, unless the config allows
    a schema change: clients built against the served schema must keep working."""
    served_version, old = reference
    if (old.inputs, old.outputs) != (new.inputs, new.outputs):

        def show(sig: Signature) -> str:
            return ", ".join(f"{t.name}:{t.describe()}" for t in sig.inputs + sig.outputs)

        raise ModelLoadError(
            f"{model_file}: schema differs from served version {served_version} "
            f"({show(new)} vs {show(old)}); set reload.allow_schema_change: true to allow it",
            "incompatible",
        )
