"""A bare grpc.aio server for modelyard.inference.v1.InferenceService: Infer echoes the inputs.

The baseline of bench/unary_latency.py: the same proto messages, the same payload and the same
gRPC server options as the service, but no model, no conversion, no metrics. Whatever the
service costs beyond this is the serving path's own overhead.

Run as a script: prints the bound port on stdout (one line), then serves until SIGTERM/SIGINT.

    .venv/bin/python bench/echo_server.py [--listen 127.0.0.1:0]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc

from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc

# The service's server options (service/server.py build_service), so that only the handler differs.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


Context = grpc.aio.ServicerContext[Any, Any]


class EchoServicer(pb_grpc.InferenceServiceServicer):
    async def Infer(self, request: pb.InferRequest, context: Context) -> pb.InferResponse:
        return pb.InferResponse(model_name=request.model_name, model_version="1", outputs=request.inputs)

    async def InferStream(
        self, request: pb.InferStreamRequest, context: Context
    ) -> AsyncIterator[pb.InferStreamResponse]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the echo server answers Infer only")
        yield pb.InferStreamResponse()  # type: ignore[unreachable]  # makes this an async generator

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the echo server answers Infer only")
        yield pb.GenerateResponse()  # type: ignore[unreachable]  # makes this an async generator


async def serve(listen: str) -> None:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_InferenceServiceServicer_to_server(EchoServicer(), server)
    port = server.add_insecure_port(listen)
    if port == 0:
        raise SystemExit(f"echo_server: cannot bind {listen}")
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    print(port, flush=True)
    await stopping.wait()
    await server.stop(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0 picks a free port)")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.listen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
