"""Sequences with `--workers 2`: a sequence lives in the worker process that took its START (the
workers share no sequence state). Its steps on one connection all reach that worker; a step that
another connection took to the other worker is refused, saying why (not routed between workers)."""

from __future__ import annotations

from pathlib import Path

import grpc

from modelyard.kserve.v2 import grpc_service_pb2_grpc as pb_grpc
from tests.sequence_models import write_triton_models
from tests.service.integration.test_sequences import step, value_of
from tests.service.integration.test_workers import connections


async def test_a_sequence_lives_in_one_worker(tmp_path: Path, service_process) -> None:
    service = service_process(write_triton_models(tmp_path / "models"), "--workers", "2")
    async with connections(service.address) as channels:
        stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]
        home = stubs[0]
        start = home.ModelInfer(step("accumulator", 5, 61, start=True))
        assert value_of(await start) == 5
        its_worker = dict(await start.trailing_metadata())["x-served-by"]
        # On its own connection, every step reaches its worker.
        for value, total in ((1, 6), (2, 8)):
            assert value_of(await home.ModelInfer(step("accumulator", value, 61))) == total
        # Another connection to the other worker (the kernel spreads connections by hash): refused,
        # with what to do; the sequence itself goes on where it lives.
        refused = None
        for stub in stubs[1:]:
            call = stub.ModelInfer(step("accumulator", 100, 61))
            try:
                await call
            except grpc.aio.AioRpcError as exc:
                refused = exc
                break
            assert dict(await call.trailing_metadata())["x-served-by"] == its_worker
        assert refused is not None, "every connection reached one worker"
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "with --workers, a sequence lives in the worker process that took its START" in (
            refused.details() or ""
        )
        # 8 + 100 for each connection that reached its worker before the refusal, then the END.
        last = await home.ModelInfer(step("accumulator", 0, 61, end=True))
        assert value_of(last) % 100 == 8
