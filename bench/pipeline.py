"""CPU per call of the service's request pipeline (service/api/pipeline.py, the order of
service/server.py's request_pipelines) around a servicer that answers at once, without gRPC or a
model: what the wrappers add to each call, per call kind, with and without a guard (one that
admits every call, so that the authorizer's own cost is left out).

    .venv/bin/python -m bench.pipeline [--calls 20000] [--repeats 5]

"none" is the servicer behind only the parse that gRPC does without the pipeline (FromString).
Figures: the best of `--repeats` runs of `--calls` calls each, in microseconds of process CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as pb_grpc
from modelyard.service.api.pipeline import Handler, service_of, wrapped
from modelyard.service.metrics import ServiceMetrics
from modelyard.service.server import request_pipelines

_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # not in grpc's type stubs

REQUEST = pb.ModelInferRequest(model_name="tiny")
REQUEST.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16]).contents.fp32_contents.extend([1.0] * 16)
RAW = REQUEST.SerializeToString()
RESPONSE = pb.ModelInferResponse(model_name="tiny")
STREAM_RESPONSE = pb.ModelStreamInferResponse(infer_response=RESPONSE)


class _Servicer(pb_grpc.GRPCInferenceServiceServicer):
    async def ModelInfer(self, request: Any, context: Any) -> Any:
        return RESPONSE

    async def ModelStreamInfer(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        async for _ in requests:
            yield STREAM_RESPONSE


class _Context:
    """What the wrappers use of a grpc.aio context, for a call that passes every check."""

    def __init__(self) -> None:
        self._sent = False

    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def read(self) -> Any:
        self._sent, sent = True, self._sent
        return _EOF if sent else RAW

    async def abort(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"a call of the benchmark was refused: {args}")


async def _admit(context: Any) -> None:
    return None


def _call_of(handler: Handler, parse: Callable[[bytes], Any] | None) -> Callable[[], Awaitable[Any]]:
    """One call of `handler`'s behaviour, as gRPC makes it (`parse`: gRPC's deserializer)."""
    h: Any = handler
    if h.unary_unary is not None:
        return lambda: h.unary_unary(parse(RAW) if parse is not None else RAW, _Context())
    if h.stream_unary is not None:  # a guarded unary method: it reads its message itself
        return lambda: h.stream_unary(None, _Context())

    async def requests() -> AsyncIterator[Any]:
        yield parse(RAW) if parse is not None else RAW

    async def stream() -> None:
        async for _ in h.stream_stream(requests(), _Context()):
            pass

    return stream


async def _cpu_us(call: Callable[[], Awaitable[Any]], calls: int, repeats: int) -> float:
    for _ in range(min(calls, 2000)):  # warm-up
        await call()
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        for _ in range(calls):
            await call()
        best = min(best, (time.process_time() - started) / calls * 1e6)
    return best


async def run(calls: int, repeats: int) -> None:
    servicer = _Servicer()  # type: ignore[abstract]  # the two methods measured are enough
    service = service_of(pb.DESCRIPTOR.services_by_name["GRPCInferenceService"], servicer)
    metrics = ServiceMetrics()
    pipelines = {
        "none": None,
        "unguarded": request_pipelines(64 << 20, metrics, lambda method: None, None, None).apis,
        "guarded": request_pipelines(64 << 20, metrics, lambda method: None, lambda m: _admit, None).apis,
    }
    print(f"{'method':18} {'pipeline':10} {'CPU us/call':>11}")
    for method in ("ModelInfer", "ModelStreamInfer"):
        for label, pipeline in pipelines.items():
            original = service.handlers[method]
            if pipeline is None:
                call = _call_of(original, original.request_deserializer)
            else:
                call = _call_of(wrapped(service, pipeline)[method], None)
            print(f"{method:18} {label:10} {await _cpu_us(call, calls, repeats):11.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    asyncio.run(run(args.calls, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
