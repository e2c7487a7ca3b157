"""Large tensors: our FlatBuffers Infer (modelyard.flat, proto/modelyard/flat/v1/inference.fbs)
against protobuf's raw little-endian bytes (our v1 InferRequest/InferResponse), 1, 16 and 64 MiB
per request, in one run.

A bare grpc.aio server (pinned to core 1; this client to core 0) answers two methods that do the
same: decode the request's tensor into numpy, and answer it back as the response's tensor (the
model is left out: only the encoding is measured). The client encodes the request and decodes the
answer into numpy too. Per size, the two encodings alternate for --rounds rounds of --requests
calls at concurrency 1; reported: p50 latency, throughput, and server CPU per request.

Copies of the tensor's bytes each encoding makes in Python (besides gRPC's own, the same for both):
  protobuf, receiving: ParseFromString copies raw_data into the message (1), reading the field
    makes a bytes object (1), np.frombuffer is a view (0): 2.
  protobuf, sending: ndarray.tobytes (1), setting raw_data (1), SerializeToString (1): 3.
  FlatBuffers, receiving: the data vector is a numpy view of the received bytes: 0.
  FlatBuffers, sending: the array is staged in a bytearray (1) that the builder copies into its
    buffer (1) (its public API writes byte vectors from bytes or bytearrays only), and gRPC's
    Python API takes bytes, so the finished buffer is copied out once (1): 3.

    .venv/bin/python -m bench.flatbuffers_tensors [--sizes-mib 1,16,64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.processes import CLK_TCK, ROOT, SERVICE_READY
from models.demo_models import scaled_identity, write_model
from modelyard import flat
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import tensor_pb2

LIMIT = 256 * 1024 * 1024
OPTIONS = [("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)]
PROTO, FLAT = "/bench.Tensors/Proto", "/bench.Tensors/Flat"
INFER = "/modelyard.inference.v1.InferenceService/Infer"
DEFAULT_OUTPUT = ROOT / "bench" / "results" / "flatbuffers_tensors.json"

# -- the FlatBuffers encoding: modelyard.flat, the service's own ------------------------------


def flat_request(array: np.ndarray, model: str = "echo") -> bytes:
    return flat.encode_request(model, {"INPUT0": array})


def flat_decode_request(buffer: bytes) -> np.ndarray:
    """The request's tensor as a read-only numpy view of `buffer` (no copy)."""
    return flat.decode_request(buffer).tensors["INPUT0"]


def flat_response(array: np.ndarray) -> bytes:
    return flat.encode_response("echo", "", {"OUTPUT0": array})


def flat_decode_response(buffer: bytes) -> np.ndarray:
    return flat.decode_response(buffer).tensors["OUTPUT0"]


# -- the protobuf encoding (raw little-endian bytes) -----------------------------------------


def proto_request(array: np.ndarray, model: str = "echo") -> bytes:
    tensor = tensor_pb2.Tensor(
        name="INPUT0", datatype=tensor_pb2.DATA_TYPE_FP32, shape=array.shape, raw_data=array.tobytes()
    )
    return pb.InferRequest(model_name=model, inputs=[tensor]).SerializeToString()


def proto_decode_request(buffer: bytes) -> np.ndarray:
    tensor = pb.InferRequest.FromString(buffer).inputs[0]
    return np.frombuffer(tensor.raw_data, "<f4").reshape(tuple(tensor.shape))


def proto_response(array: np.ndarray) -> bytes:
    tensor = tensor_pb2.Tensor(
        name="OUTPUT0", datatype=tensor_pb2.DATA_TYPE_FP32, shape=array.shape, raw_data=array.tobytes()
    )
    return pb.InferResponse(model_name="echo", outputs=[tensor]).SerializeToString()


def proto_decode_response(buffer: bytes) -> np.ndarray:
    tensor = pb.InferResponse.FromString(buffer).outputs[0]
    return np.frombuffer(tensor.raw_data, "<f4").reshape(tuple(tensor.shape))


# -- server ----------------------------------------------------------------------------------


async def serve() -> None:
    async def proto(request: bytes, context: Any) -> bytes:
        return proto_response(proto_decode_request(request))

    async def flat_echo(request: bytes, context: Any) -> bytes:
        return flat_response(flat_decode_request(request))

    server = grpc.aio.server(options=OPTIONS)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "bench.Tensors",
                {
                    "Proto": grpc.unary_unary_rpc_method_handler(proto),
                    "Flat": grpc.unary_unary_rpc_method_handler(flat_echo),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


# -- client ----------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


async def measure(
    channel: grpc.aio.Channel, pid: int, method: str, array: np.ndarray, n: int, service: bool, model: str
) -> dict[str, float]:
    target = (INFER if method == PROTO else flat.METHOD) if service else method
    call = channel.unary_unary(target, None, None)
    latencies = []
    cpu0 = cpu_seconds(pid)
    start = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        if method == PROTO:
            answer = proto_decode_response(await call(proto_request(array, model)))
        else:
            answer = flat_decode_response(await call(flat_request(array, model)))
        latencies.append(time.perf_counter() - t0)
        assert answer.shape == array.shape
    wall = time.perf_counter() - start
    return {
        "p50_ms": statistics.median(latencies) * 1e3,
        "throughput": n / wall,
        "server_cpu_ms_per_request": (cpu_seconds(pid) - cpu0) / n * 1e3,
    }


def start_server(args: argparse.Namespace, workdir: Path) -> subprocess.Popen[str]:
    """The server in a child process (on core 1 when there are two); this process moves to core 0.
    With --service: the service, on identity models of each size (modelyard.flat.v1 against our v1
    Infer); else the bare server above."""
    pin = (os.cpu_count() or 1) >= 2
    if pin:
        os.sched_setaffinity(0, {0})
    prefix = ["taskset", "-c", "1"] if pin else []
    if not args.service:
        argv = [*prefix, sys.executable, "-m", "bench.flatbuffers_tensors", "--serve"]
        return subprocess.Popen(argv, stdout=subprocess.PIPE, cwd=ROOT, text=True)
    for mib in args.sizes_mib:
        write_model(workdir, f"id{mib}", 1, scaled_identity(mib * 1024 * 1024 // 4, 1.0, batch=False), {})
    argv = [
        *(
            *prefix,
            sys.executable,
            "-m",
            "modelyard.service",
            "--repository",
            str(workdir),
            "--listen",
            "127.0.0.1:0",
        ),
        *("--metrics-listen", "", "--max-message-bytes", str(LIMIT // 2)),
    ]
    return subprocess.Popen(argv, stderr=subprocess.PIPE, cwd=ROOT, text=True)


def server_port(server: subprocess.Popen[str], service: bool) -> int:
    if not service:
        assert server.stdout is not None
        return int(server.stdout.readline())
    assert server.stderr is not None
    for line in server.stderr:
        if match := SERVICE_READY.search(line):
            threading.Thread(target=server.stderr.read, daemon=True).start()  # keep the pipe drained
            return int(match.group(1))
    raise RuntimeError("the service did not start")


async def run(args: argparse.Namespace, server: subprocess.Popen[str]) -> int:
    pin = (os.cpu_count() or 1) >= 2
    try:
        port = server_port(server, args.service)
        rows = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
            for mib in args.sizes_mib:
                array = np.random.default_rng(0).standard_normal((mib * 1024 * 1024 // 4,), np.float32)
                n = max(3, args.requests // mib)
                np.testing.assert_array_equal(flat_decode_request(flat_request(array)), array)
                model = f"id{mib}"
                for method in (PROTO, FLAT):  # warm-up
                    await measure(channel, server.pid, method, array, 2, args.service, model)
                for round_ in range(args.rounds):
                    order = (PROTO, FLAT) if round_ % 2 == 0 else (FLAT, PROTO)
                    for method in order:
                        result = await measure(channel, server.pid, method, array, n, args.service, model)
                        name = "protobuf" if method == PROTO else "flatbuffers"
                        rows.append({"mib": mib, "round": round_, "encoding": name, **result})
                        print(
                            f"{mib:>3} MiB {name:<11} p50 {result['p50_ms']:8.2f} ms  "
                            f"{result['throughput']:7.1f} req/s  server CPU "
                            f"{result['server_cpu_ms_per_request']:7.2f} ms/req",
                            file=sys.stderr,
                        )
    finally:
        server.terminate()
        server.wait(10)
    print("\nflatbuffers / protobuf, median of paired rounds (below 1: FlatBuffers is faster)")
    summary = {}
    for mib in args.sizes_mib:
        ratios: dict[str, list[float]] = {"p50_ms": [], "throughput": [], "server_cpu_ms_per_request": []}
        for round_ in range(args.rounds):
            pair = {r["encoding"]: r for r in rows if r["mib"] == mib and r["round"] == round_}
            for key in ratios:
                ratios[key].append(pair["flatbuffers"][key] / pair["protobuf"][key])
        summary[mib] = {k: round(statistics.median(v), 3) for k, v in ratios.items()}
        s = summary[mib]
        print(
            f"{mib:>3} MiB  p50 {s['p50_ms']:.2f}x  throughput {s['throughput']:.2f}x  "
            f"server CPU {s['server_cpu_ms_per_request']:.2f}x"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    document = {"pinned": pin, "through_service": args.service, "summary": summary, "rows": rows}
    args.output.write_text(json.dumps(document, indent=2))
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.flatbuffers_tensors", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=lambda t: [int(v) for v in t.split(",")], default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--requests", type=int, default=64, help="requests per round at 1 MiB (fewer when larger)"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--service", action="store_true", help="through the service (identity models)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        asyncio.run(serve())
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-flat-") as tmp:
        return asyncio.run(run(args, start_server(args, Path(tmp))))


if __name__ == "__main__":
    sys.exit(main())
