"""System shared memory against inline tensors, over KServe V2 gRPC, for 1, 16 and 64 MiB.

One FP32 Identity model ([1, n]); each request sends one tensor of the size and gets it back.
Inline: the tensor travels in raw_input_contents and returns in raw_output_contents. Shared
memory: the client writes the input into a registered POSIX shared-memory region and the service
writes the output into another, so only metadata crosses gRPC. Requests run one at a time; the
figure is the median latency over `--requests` calls after two warm-up calls, per size and path.

    .venv/bin/python -m bench.shm [--sizes 1,16,64] [--requests 10]

Results go to bench/results/shm.json. Everything runs on 127.0.0.1; the service process and the
shared-memory objects made here are removed before exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from multiprocessing import shared_memory
from pathlib import Path

import grpc
import numpy as np
from onnx import TensorProto, helper

from bench.processes import ROOT, running_service
from models.demo_models import make_model, write_model
from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as pb_grpc

MIB = 1024 * 1024
RESULTS = ROOT / "bench" / "results" / "shm.json"


def identity_model() -> object:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "n"])],
    )
    return make_model(graph, "FP32 identity")


def request(n: int, data: bytes | None, shm: bool) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="identity")
    tensor = req.inputs.add(name="x", datatype="FP32", shape=[1, n])
    out = req.outputs.add(name="y")
    if shm:
        tensor.parameters["shared_memory_region"].string_param = "in"
        tensor.parameters["shared_memory_byte_size"].int64_param = n * 4
        out.parameters["shared_memory_region"].string_param = "out"
        out.parameters["shared_memory_byte_size"].int64_param = n * 4
    else:
        assert data is not None
        req.raw_input_contents.append(data)
    return req


async def timed(
    stub: pb_grpc.GRPCInferenceServiceAsyncStub, req: pb.ModelInferRequest, count: int
) -> list[float]:
    times = []
    for _ in range(count + 2):
        start = time.perf_counter()
        await stub.ModelInfer(req)
        times.append(time.perf_counter() - start)
    return times[2:]


async def main_async(sizes: list[int], count: int) -> dict[str, object]:
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="bench-shm-") as tmp:
        work = Path(tmp)
        write_model(work / "models", "identity", 1, identity_model(), {"max_batch_size": 1})  # type: ignore[arg-type]
        limit = str(max(sizes) * MIB + MIB)
        # The bench registers its regions without a credential: management open (loopback, its own service).
        async with running_service(
            work / "models", work, "--management-open", "--max-message-bytes", limit
        ) as server:
            options = [
                ("grpc.max_receive_message_length", int(limit)),
                ("grpc.max_send_message_length", int(limit)),
            ]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
                stub: pb_grpc.GRPCInferenceServiceAsyncStub = pb_grpc.GRPCInferenceServiceStub(channel)
                for size in sizes:
                    n = size * MIB // 4
                    x = np.random.default_rng(size).standard_normal((1, n), dtype=np.float32)
                    inline = await timed(stub, request(n, x.tobytes(), shm=False), count)
                    tag = f"modelyard_bench_{os.getpid()}_{size}"
                    regions = [
                        shared_memory.SharedMemory(f"{tag}_{d}", create=True, size=x.nbytes) for d in "io"
                    ]
                    try:
                        regions[0].buf[: x.nbytes] = x.tobytes()
                        await stub.SystemSharedMemoryRegister(
                            pb.SystemSharedMemoryRegisterRequest(
                                name="in", key=f"/{tag}_i", byte_size=x.nbytes
                            )
                        )
                        await stub.SystemSharedMemoryRegister(
                            pb.SystemSharedMemoryRegisterRequest(
                                name="out", key=f"/{tag}_o", byte_size=x.nbytes
                            )
                        )
                        via_shm = await timed(stub, request(n, None, shm=True), count)
                        back = np.frombuffer(regions[1].buf, np.float32, count=n)
                        assert np.array_equal(back, x.reshape(-1)), (
                            "the output region does not hold the input"
                        )
                        del back
                        await stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest())
                    finally:
                        for region in regions:
                            region.close()
                            region.unlink()
                    row = {
                        "inline_ms": round(statistics.median(inline) * 1e3, 2),
                        "shm_ms": round(statistics.median(via_shm) * 1e3, 2),
                    }
                    row["speedup"] = round(row["inline_ms"] / row["shm_ms"], 2)
                    results[f"{size}MiB"] = row
                    print(
                        f"{size:>3} MiB  inline {row['inline_ms']:8.2f} ms  shm {row['shm_ms']:8.2f} ms  "
                        f"x{row['speedup']}",
                        flush=True,
                    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1,16,64", help="tensor sizes in MiB, comma-separated")
    parser.add_argument("--requests", type=int, default=10, help="timed requests per size and path")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = asyncio.run(main_async(sizes, args.requests))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"median_latency": results, "requests": args.requests}, indent=2) + "\n")


if __name__ == "__main__":
    main()
