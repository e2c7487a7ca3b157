"""Infer on the CPU and on CUDA side by side, in one run: the service against a bare ONNX Runtime
loop on the same model file and provider, for the GPU check (bench/gpu_check.sh).

    .venv/bin/python -m bench.gpu [--providers cpu,cuda] [--duration 3] [--out FILE]

Two models built here: `mlp` (models.demo_models.dense_stack: 32 x MatMul 512x512 + Relu, weight
bound) and `encoder` (a MiniLM-L6-shaped transformer encoder over 128 positions; 43 MB). For each
provider and model:

- bare: one ONNX Runtime session on that provider, `session.run` back to back in this process:
  p50 at batch 1, rows/s at batch 64. Nothing a server does; the floor.
- service: `python -m modelyard.service` serving the same files with `execution.provider` set,
  called through our v1 Infer: p50 at concurrency 1 and batch 1, rows/s at concurrency 16 and batch
  1 (dynamic batching on), rows/s at concurrency 4 and batch 64.
- overhead: the service's p50 over the bare p50 at batch 1 (what gRPC, scheduling and the tensor
  conversions add to one call).
- on CUDA, the service twice: its runs through IO binding (the default) and through plain
  `session.run` (`execution.io_binding: false`, models `<name>_plain` in the same service), so
  that the binding is judged by its figures.

With CUDA, the devices' used memory (NVML) is read before the service starts, once it serves and
after it stops. A provider this host cannot run (CUDA without a GPU) is reported as skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import onnxruntime as ort

from bench.lib.load import drive
from bench.lib.report import write_json
from bench.processes import running_service
from models.demo_models import dense_stack, encoder, serialize, write_model
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.service.gpu_memory import used_mib
from modelyard.service.runtime.providers import CPU, CUDA, detect_providers
from modelyard.tensors import to_tensor

PROVIDERS = {"cpu": CPU, "cuda": CUDA}
PLAIN = "_plain"  # the same model on CUDA without IO binding (execution.io_binding: false)
BIG_BATCH = 64


def models() -> dict[str, tuple[onnx.ModelProto, tuple[int, ...]]]:
    """name -> (model, one row's shape)."""
    return {"mlp": (dense_stack(32, 512), (512,)), "encoder": (encoder(), (128, 384))}


def rows(shape: Sequence[int], batch: int) -> np.ndarray:
    return np.random.default_rng(batch).standard_normal((batch, *shape), dtype=np.float32)


def bare(model: bytes, shape: Sequence[int], provider: str, duration_s: float) -> dict[str, float]:
    session = ort.InferenceSession(model, providers=[provider])
    if session.get_providers()[0] != provider:
        raise RuntimeError(f"the bare session fell back to {session.get_providers()[0]}")
    result: dict[str, float] = {}
    for batch in (1, BIG_BATCH):
        feeds = {"INPUT0": rows(shape, batch)}
        for _ in range(3):  # warm-up: CUDA kernels chosen, arena grown
            session.run(None, feeds)
        times: list[float] = []
        end = time.perf_counter() + duration_s
        while time.perf_counter() < end or len(times) < 5:
            start = time.perf_counter()
            session.run(None, feeds)
            times.append(time.perf_counter() - start)
        if batch == 1:
            result["p50_ms"] = statistics.median(times) * 1e3
        else:
            result[f"rows_per_s_b{batch}"] = batch * len(times) / sum(times)
    return result


async def service(
    repository: Path,
    workdir: Path,
    shapes: dict[str, tuple[int, ...]],  # model name -> one row's shape
    duration_s: float,
    floors: dict[str, dict[str, float]],
) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    async with (
        running_service(repository, workdir) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub: Any = pb_grpc.InferenceServiceStub(channel)
        memory_serving = used_mib()
        for name, shape in shapes.items():

            def request(batch: int, model: str = name, row: tuple[int, ...] = shape) -> pb.InferRequest:
                return pb.InferRequest(model_name=model, inputs=[to_tensor("INPUT0", rows(row, batch))])

            one, big = request(1), request(BIG_BATCH)
            latencies, _ = await drive(stub.Infer, one, 1, 1.0, duration_s)
            one_s = floors[name]["p50_ms"] / 1e3
            concurrent, window = await drive(stub.Infer, one, 16, 1.0, max(duration_s, 32 * one_s))
            # Long enough for a few batch-64 answers where each takes seconds (the encoder on a CPU).
            per_run_s = BIG_BATCH / floors[name][f"rows_per_s_b{BIG_BATCH}"]
            batched, window_big = await drive(
                stub.Infer, big, 4, 4 * per_run_s, max(duration_s, 8 * per_run_s)
            )
            results[name] = {
                "p50_ms": float(np.median(latencies)) / 1e6,
                "rows_per_s_c16_b1": concurrent.size / window,
                f"rows_per_s_c4_b{BIG_BATCH}": BIG_BATCH * batched.size / window_big,
            }
        if memory_serving is not None:
            results["device_memory_mb"] = {"serving": memory_serving}
    return results


async def measure(providers: Sequence[str], duration_s: float) -> dict[str, Any]:
    built = models()
    shapes = {name: shape for name, (_, shape) in built.items()}
    choice = detect_providers()
    report: dict[str, Any] = {"host": {"cores": os.cpu_count(), "providers": choice.summary()}}
    for key in providers:
        provider = PROVIDERS[key]
        if provider == CUDA and not choice.cuda_usable:
            report[key] = {"skipped": choice.reason}
            continue
        section: dict[str, Any] = {"device_memory_mb": {"before": used_mib()}}
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "models"
            variants = {"": True, PLAIN: False} if provider == CUDA else {"": True}
            for name, (model, _) in built.items():
                for suffix, binding in variants.items():
                    execution = {"provider": key} if binding else {"provider": key, "io_binding": False}
                    config: dict[str, Any] = {"max_batch_size": BIG_BATCH, "execution": execution}
                    config["dynamic_batching"] = {"max_queue_delay_us": 500}
                    write_model(root, name + suffix, 1, model, config)
            floors = {
                name: bare(serialize(model), shape, provider, duration_s)
                for name, (model, shape) in built.items()
            }
            served_shapes = {name + suffix: shapes[name] for name in built for suffix in variants}
            served_floors = {name + suffix: floors[name] for name in built for suffix in variants}
            served = await service(root, Path(tmp), served_shapes, duration_s, served_floors)
        section["device_memory_mb"].update(served.pop("device_memory_mb", {}), after=used_mib())
        for name in built:
            section[name] = {
                "bare": floors[name],
                "service": served[name],
                "overhead_p50": served[name]["p50_ms"] / floors[name]["p50_ms"],
            }
            if name + PLAIN in served:
                section[name]["service" + PLAIN] = served[name + PLAIN]
        report[key] = section
    return report


def print_report(report: dict[str, Any]) -> None:
    print(
        f"Infer, CPU and CUDA side by side ({report['host']['cores']} cores): {report['host']['providers']}"
    )
    header = f"{'provider':<9}{'model':<9}{'bare p50 ms':>12}{'svc p50 ms':>11}{'overhead':>9}"
    print(header + f"{'bare rows/s b64':>16}{'svc rows/s c16 b1':>18}{'svc rows/s c4 b64':>18}")
    for key in PROVIDERS:
        section = report.get(key)
        if section is None:
            continue
        if "skipped" in section:
            print(f"{key:<9}skipped: {section['skipped']}")
            continue
        for name in ("mlp", "encoder"):
            b, s = section[name]["bare"], section[name]["service"]
            print(
                f"{key:<9}{name:<9}{b['p50_ms']:>12.3f}{s['p50_ms']:>11.3f}{section[name]['overhead_p50']:>8.2f}x"
                f"{b[f'rows_per_s_b{BIG_BATCH}']:>16.0f}{s['rows_per_s_c16_b1']:>18.0f}"
                f"{s[f'rows_per_s_c4_b{BIG_BATCH}']:>18.0f}"
            )
            plain = section[name].get("service" + PLAIN)
            if plain is not None:
                print(
                    f"{key:<9}{'  plain':<9}{'':>12}{plain['p50_ms']:>11.3f}{'':>9}{'':>16}"
                    f"{plain['rows_per_s_c16_b1']:>18.0f}{plain[f'rows_per_s_c4_b{BIG_BATCH}']:>18.0f}"
                    "  (no IO binding)"
                )
        memory = section["device_memory_mb"]
        if memory.get("before") is not None:
            print(f"{'':<9}device memory used, MB: {json.dumps(memory)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--providers", default="cpu,cuda", help="comma-separated: cpu, cuda")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu.json"))
    args = parser.parse_args()
    wanted = [p for p in args.providers.split(",") if p]
    unknown = [p for p in wanted if p not in PROVIDERS]
    if unknown:
        parser.error(f"--providers: unknown {unknown}; choose from {sorted(PROVIDERS)}")
    report = asyncio.run(measure(wanted, args.duration))
    print_report(report)
    write_json(args.out, report)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
