"""KServe ModelMetadata lists the served versions as they were when it chose the version that
answers, and names that version in x-served-version (trailing metadata: a unary answer): a swap
right after it answers changes neither."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from models import demo_models
from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.service.api.errors import Context
from modelyard.service.api.kserve.servicer import KServeServicer
from modelyard.service.dataplane import DataPlane
from modelyard.service.metrics import ServiceMetrics
from modelyard.service.runtime.manager import ModelManager
from modelyard.service.runtime.providers import ProviderChoice


class SwapOnAnswer:
    """A servicer context whose x-served-version (set in the trailing metadata) is followed by a
    swap of the model's versions (v2 replaces v1, the default policy serving the latest only), as a
    reload landing at once would. Initial metadata sent by the handler would be a write of its own
    (grpc.aio): a unary answer sends none."""

    def __init__(self, manager: ModelManager, repository: Path) -> None:
        self._manager = manager
        self._repository = repository
        self.initial: list[Any] = []
        self.trailing: list[tuple[tuple[str, str], ...]] = []

    async def send_initial_metadata(self, metadata: Any) -> None:
        self.initial.append(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing.append(metadata)

    async def swap(self) -> None:
        demo_models.write_model(self._repository, "m", 2, demo_models.scaled_identity(4, 2.0))
        await self._manager.reconcile("m")


async def test_model_metadata_lists_the_versions_it_answered_from_though_a_swap_came_between(
    tmp_path: Path,
) -> None:
    demo_models.write_model(tmp_path, "m", 1, demo_models.scaled_identity(4, 1.0))
    manager = ModelManager(tmp_path, ProviderChoice(False, "test: CPU"), drain_timeout_s=10.0)
    executor = ThreadPoolExecutor(max_workers=1)
    try:
        await manager.load_all()
        servicer = KServeServicer(manager, DataPlane(manager, executor), ServiceMetrics())
        context = SwapOnAnswer(manager, tmp_path)
        response = await servicer.ModelMetadata(pb.ModelMetadataRequest(name="m"), cast(Context, context))
        await context.swap()
        assert manager.resolve("m").version == 2  # the swap did happen
        assert context.initial == []
        assert dict(context.trailing[-1])["x-served-version"] == "1"
        assert list(response.versions) == ["1"]
    finally:
        await manager.close()
        executor.shutdown()
