"""The thinnest Python server that serves a model: grpc.aio, KServe V2 ModelInfer and our v1
Infer, `session.run` inline in the handler, raw little-endian tensors, one intra-op thread. No
checks beyond what decoding needs, no metrics, no queues: the floor that bench/floor.py measures
the service against.

Run as a script: prints the bound port on stdout (one line), then serves until SIGTERM/SIGINT.

    .venv/bin/python bench/bare_server.py REPOSITORY [--listen 127.0.0.1:0] [--served-only]

By default both services are added the generated way (add_*Servicer_to_server), as a plain
grpc.aio server is written: every method of both becomes a grpc.aio registered method, and the
server waits on one pending request per registered method at every call, so each of the ~24
here adds to every call's cost (docs/benchmarks.md, "Costs the code is shaped by"). The service
registers none (service/api/pipeline.py). --served-only is the stricter floor: the two served
methods in one generic handler, no registered method.

REPOSITORY holds <model>/1/model.onnx (the service's layout); every model in it is served.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort

from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import tensor_pb2
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kgrpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
Context = grpc.aio.ServicerContext[Any, Any]


def load(repository: Path) -> dict[str, ort.InferenceSession]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return {
        path.parent.parent.name: ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        for path in sorted(repository.glob("*/1/model.onnx"))
    }


class Bare(kgrpc.GRPCInferenceServiceServicer, pb_grpc.InferenceServiceServicer):
    def __init__(self, sessions: dict[str, ort.InferenceSession]) -> None:
        self._sessions = sessions

    async def ModelInfer(self, request: kpb.ModelInferRequest, context: Context) -> kpb.ModelInferResponse:
        session = self._sessions[request.model_name]
        feeds = {
            t.name: np.frombuffer(raw, np.float32).reshape(t.shape)
            for t, raw in zip(request.inputs, request.raw_input_contents, strict=True)
        }
        outputs = session.run(None, feeds)
        response = kpb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
        for meta, array in zip(session.get_outputs(), outputs, strict=True):
            response.outputs.add(name=meta.name, datatype="FP32", shape=array.shape)
            response.raw_output_contents.append(array.tobytes())
        return response

    async def Infer(self, request: pb.InferRequest, context: Context) -> pb.InferResponse:
        session = self._sessions[request.model_name]
        feeds = {t.name: np.frombuffer(t.raw_data, np.float32).reshape(t.shape) for t in request.inputs}
        outputs = session.run(None, feeds)
        return pb.InferResponse(
            model_name=request.model_name,
            model_version="1",
            outputs=[
                tensor_pb2.Tensor(
                    name=meta.name, datatype=tensor_pb2.DATA_TYPE_FP32, shape=a.shape, raw_data=a.tobytes()
                )
                for meta, a in zip(session.get_outputs(), outputs, strict=True)
            ],
        )


def served_only(bare: Bare) -> grpc.GenericRpcHandler[Any, Any]:
    """ModelInfer and Infer, found by full name, as the only methods (none registered)."""
    handlers = {
        "/inference.GRPCInferenceService/ModelInfer": grpc.unary_unary_rpc_method_handler(
            bare.ModelInfer, kpb.ModelInferRequest.FromString, kpb.ModelInferResponse.SerializeToString
        ),
        "/modelyard.inference.v1.InferenceService/Infer": grpc.unary_unary_rpc_method_handler(
            bare.Infer, pb.InferRequest.FromString, pb.InferResponse.SerializeToString
        ),
    }

    class Methods(grpc.GenericRpcHandler):  # type: ignore[type-arg]
        def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
            return handlers.get(handler_call_details.method)

    return Methods()


async def serve(repository: Path, listen: str, only_served: bool = False) -> None:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    bare = Bare(load(repository))  # type: ignore[abstract]  # serves two methods only
    if only_served:
        server.add_generic_rpc_handlers((served_only(bare),))
    else:
        kgrpc.add_GRPCInferenceServiceServicer_to_server(bare, server)
        pb_grpc.add_InferenceServiceServicer_to_server(bare, server)
    port = server.add_insecure_port(listen)
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
    parser.add_argument("repository", type=Path)
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument(
        "--served-only", action="store_true", help="the two served methods only, none a registered method"
    )
    args = parser.parse_args(argv)
    asyncio.run(serve(args.repository, args.listen, args.served_only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
