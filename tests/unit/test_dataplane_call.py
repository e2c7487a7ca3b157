"""DataPlane.open: a request resolves its version once and holds it to the end, whatever swaps
the table in the meantime (a hot reload between its decoding and its run)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from models import demo_models
from modelyard.service.dataplane import DataPlane
from modelyard.service.intake import TensorHeader
from modelyard.service.runtime.manager import ModelManager
from modelyard.service.runtime.providers import ProviderChoice
from tests.support import eventually


async def test_a_call_runs_on_the_version_it_resolved_though_a_reload_swapped_the_table(
    tmp_path: Path,
) -> None:
    demo_models.write_model(tmp_path, "m", 1, demo_models.scaled_identity(4, 1.0))
    manager = ModelManager(tmp_path, ProviderChoice(False, "test: CPU"), drain_timeout_s=10.0)
    executor = ThreadPoolExecutor(max_workers=1)
    try:
        await manager.load_all()
        plane = DataPlane(manager, executor)
        x = np.ones((1, 4), np.float32)
        headers = [TensorHeader("INPUT0", "FP32", (1, 4), x.nbytes, False)]
        with plane.open("m", "") as held:
            inputs = await held.decode(headers, lambda: {"INPUT0": x})
            # A new version arrives and is swapped in while this request holds version 1.
            demo_models.write_model(tmp_path, "m", 2, demo_models.scaled_identity(4, 2.0))
            await manager.reconcile("m")
            assert manager.resolve("m").version == 2
            result = await held.infer(inputs)
            assert (result.version, result.outputs["OUTPUT0"].tolist()) == (1, x.tolist())
            assert held.served.in_flight == 1 and manager.retiring == 1  # it drains behind us
        assert held.served.in_flight == 0
        await eventually(lambda: not manager.retiring, "version 1 to retire")
        assert (await plane.infer("m", "", inputs)).version == 2
    finally:
        await manager.close()
        executor.shutdown()
