"""The service's request steps timed in-process (no gRPC): the handlers and each step of Infer,
called directly on the objects the service builds, per call."""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from modelyard.inference.v1 import inference_service_pb2 as pb


def _per_call_us(fn: Callable[[], object], iterations: int, batches: int = 5) -> float:
    times = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(iterations):
            fn()
        times.append((time.perf_counter_ns() - t0) / iterations / 1e3)
    return min(times)  # the least disturbed batch


async def _per_await_us(fn: Callable[[], Awaitable[object]], iterations: int, batches: int = 5) -> float:
    times = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(iterations):
            await fn()
        times.append((time.perf_counter_ns() - t0) / iterations / 1e3)
    return min(times)


async def breakdown(repository: Path, request: pb.InferRequest, iterations: int) -> dict[str, float]:
    """Per-call CPU cost (us) of the handlers and of each step of the service's Infer, in this
    process: the same objects the service builds, called directly. Uses service internals, so it
    reports what it could not time instead of failing the benchmark."""
    model = request.model_name
    from concurrent.futures import ThreadPoolExecutor

    from bench.echo_server import EchoServicer
    from modelyard.service.api.errors import serving
    from modelyard.service.api.inference_servicer import InferenceServicer
    from modelyard.service.dataplane import DataPlane
    from modelyard.service.metrics import ServiceMetrics
    from modelyard.service.runtime.manager import ModelManager
    from modelyard.service.runtime.providers import ProviderChoice
    from modelyard.tensors import to_arrays, to_tensors

    class Context:  # what a successful Infer asks of its context; anything else means it failed
        def time_remaining(self) -> float | None:
            return None

        def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
            return ()

        async def send_initial_metadata(self, metadata: object) -> None:
            pass

        def set_trailing_metadata(self, metadata: object) -> None:
            pass

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"context.{name} used: the request failed")

    results: dict[str, float] = {}
    context: Any = Context()
    executor = ThreadPoolExecutor(max_workers=2)
    manager = ModelManager(repository, ProviderChoice(False, "benchmark: CPU"))
    try:
        await manager.load_all()
        metrics = ServiceMetrics()
        metrics.known_models.add(model)
        dataplane = DataPlane(manager, executor)
        # Built by parameter name, so that collaborators Infer does not use (they get None) can come
        # and go without breaking the benchmark.
        known: dict[str, Any] = {"dataplane": dataplane, "metrics": metrics}
        params = list(inspect.signature(InferenceServicer.__init__).parameters)[1:]
        servicer = InferenceServicer(**{name: known.get(name) for name in params})
        echo = EchoServicer()  # the echo server's own handler class
        wire = request.SerializeToString()
        served = manager.resolve(model)
        runner = served.runner
        arrays = to_arrays(request.inputs)
        names = runner.signature.select_outputs(list(request.output_names))
        outputs = dict(zip(names, runner.run(arrays, names), strict=True))
        tensors = to_tensors(outputs)
        response = await servicer.Infer(request, context)
        wire_response = response.SerializeToString()

        async def empty_serving() -> None:
            async with serving(context, metrics, "Infer", model):
                pass

        def lease_and_check() -> None:
            with dataplane.open(model, "") as call:
                call.served.runner.signature.check_inputs(arrays)
                call.served.runner.signature.select_outputs(request.output_names)

        n = iterations
        steps: list[tuple[str, Callable[[], object] | None, Callable[[], Awaitable[object]] | None]] = [
            (
                "echo handler: InferResponse(outputs=request.inputs)",
                None,
                lambda: echo.Infer(request, context),
            ),
            (
                "service handler: InferenceServicer.Infer (all)",
                None,
                lambda: servicer.Infer(request, context),
            ),
            ("  serving() async context manager, empty body", None, empty_serving),
            ("  to_arrays(request.inputs)", lambda: to_arrays(request.inputs), None),
            (
                "  DataPlane.infer (lease, checks, run, stats)",
                None,
                lambda: dataplane.infer(model, "", arrays, request.output_names),
            ),
            ("    lease + check_inputs + select_outputs", lease_and_check, None),
            ("    ModelRunner.run (ORT session.run)", lambda: runner.run(arrays, names), None),
            ("  to_tensors(outputs)", lambda: to_tensors(outputs), None),
            (
                "  InferResponse(...) from the built tensors",
                lambda: pb.InferResponse(model_name=model, model_version="1", outputs=tensors, request_id=""),
                None,
            ),
            (
                "  metrics.observe_request",
                lambda: metrics.observe_request("Infer", model, "1", grpc.StatusCode.OK, 1e-4),
                None,
            ),
            ("both: parse InferRequest from wire", lambda: pb.InferRequest.FromString(wire), None),
            ("both: serialize InferResponse", lambda: response.SerializeToString(), None),
            (
                "client: parse InferResponse from wire",
                lambda: pb.InferResponse.FromString(wire_response),
                None,
            ),
        ]
        for label, sync_fn, async_fn in steps:
            try:
                if sync_fn is not None:
                    sync_fn()
                    results[label] = _per_call_us(sync_fn, n)
                elif async_fn is not None:
                    await async_fn()
                    results[label] = await _per_await_us(async_fn, n)
            except Exception as exc:
                print(f"  breakdown: cannot time {label.strip()!r}: {exc!r}", file=sys.stderr)
    finally:
        await manager.close()
        executor.shutdown(wait=True)
    return results
