"""DataPlane.open: a request resolves its version once and holds it to the end, whatever swaps
the table in the meantime (a hot reload between its decoding and its run)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from models import demo_models
from modelyard.service.dataplane import Call, DataPlane, TensorReader
from modelyard.service.errors import InvalidInput
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
            reader: TensorReader[None] = TensorReader(lambda _: headers, lambda _: {"INPUT0": x})
            inputs = await held.take_inputs(1, 0, None, reader)
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


async def test_a_plain_request_is_checked_by_its_headers_and_what_they_cannot_show(tmp_path: Path) -> None:
    """take_inputs decodes a plain request from headers that fit; infer then checks only that
    every input is given and the batch sizes agree (falling back to the signature's own answer),
    and a bad plain request is refused."""
    demo_models.write_model(tmp_path, "mio", 1, demo_models.multi_io(4), {"max_batch_size": 8})
    manager = ModelManager(tmp_path, ProviderChoice(False, "test: CPU"))
    executor = ThreadPoolExecutor(max_workers=1)
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b, b3 = np.ones((2, 4), np.int64), np.ones((3, 4), np.int64)

    def plain(*tensors: tuple[str, str, np.ndarray]) -> tuple[list[TensorHeader], list[bytes]]:
        headers = [TensorHeader(n, d, x.shape, x.nbytes, False) for n, d, x in tensors]
        return headers, [x.tobytes() for _, _, x in tensors]

    def unused(source: object) -> Any:
        raise AssertionError("a plain request is decoded from its headers")

    async def take(held: Call, headers: list[TensorHeader], contents: list[bytes]) -> dict[str, np.ndarray]:
        return await held.take_inputs(
            len(headers), 0, None, TensorReader(unused, unused, lambda _: (headers, contents))
        )

    try:
        await manager.load_all()
        plane = DataPlane(manager, executor)
        with plane.open("mio", "") as held:
            inputs = await take(held, *plain(("a", "FP32", a), ("b", "INT64", b)))
            assert not inputs["a"].flags.writeable  # a view of the request's bytes
            result = await held.infer(inputs, ["sum"])
            assert result.outputs["sum"].tolist() == (a + 1).tolist()
        refusals = [
            (plain(("a", "FP32", a)), "missing input 'b'"),
            (plain(("a", "FP32", a), ("b", "INT64", b3)), "disagree on the batch size"),
            (plain(("a", "FP32", a), ("a", "FP32", a)), "'a' is given twice"),
        ]
        for (headers, contents), words in refusals:
            with plane.open("mio", "") as held, pytest.raises(InvalidInput, match=words):
                await held.infer(await take(held, headers, contents))
        short = [TensorHeader("a", "FP32", (2, 4), 28, False), TensorHeader("b", "INT64", (2, 4), 64, False)]
        with (
            plane.open("mio", "") as held,
            pytest.raises(InvalidInput, match="needs 32 bytes of raw data, got 28"),
        ):
            await take(held, short, [a.tobytes()[:28], b.tobytes()])
        stats = manager.resolve("mio").stats
        # The inputs' checks count a refusal as a failed inference (decoding errors do not, as before).
        assert (stats.success_count, stats.fail_count) == (1, 2)
    finally:
        await manager.close()
        executor.shutdown()


async def test_a_request_naming_far_more_tensors_than_the_model_has_is_refused_before_they_are_read(
    tmp_path: Path,
) -> None:
    """take_inputs refuses it from the counts alone: none of the API's readers (plain, headers,
    decode), whose work is per tensor, is called; and the lease is let go."""
    demo_models.write_model(tmp_path, "m", 1, demo_models.scaled_identity(4, 1.0))
    manager = ModelManager(tmp_path, ProviderChoice(False, "test: CPU"))
    executor = ThreadPoolExecutor(max_workers=1)
    read: list[str] = []

    def reader(name: str) -> Any:
        def read_it(source: object) -> Any:
            read.append(name)
            raise AssertionError(f"{name} was read")

        return read_it

    readers = TensorReader(reader("headers"), reader("decode"), reader("plain"))

    try:
        await manager.load_all()
        plane = DataPlane(manager, executor)
        for inputs, outputs in ((700_000, 0), (1, 700_000)):
            with plane.open("m", "") as held, pytest.raises(InvalidInput, match="the request names 700000"):
                await held.take_inputs(inputs, outputs, None, readers)
        assert read == [] and manager.resolve("m").in_flight == 0
        # At the model's own counts, the readers are used.
        with plane.open("m", "") as held, pytest.raises(AssertionError, match="plain was read"):
            await held.take_inputs(1, 1, None, readers)
    finally:
        await manager.close()
        executor.shutdown()
