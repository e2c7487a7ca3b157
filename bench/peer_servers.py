"""The established Python servers as references for bench/floor.py (`--peers kserve,mlserver`):
KServe's Python model server and MLServer, each serving the same ONNX models through its KServe V2
gRPC endpoint with the script a new user would write (bench/peers/).

Each peer runs under its own virtual environment, built by `make bench-peers` in
.cache/peers-venv/<peer> (kserve 0.21 and mlserver 1.7 pin clashing versions of fastapi and
starlette, and neither may enter our .venv). Ports are chosen free on 127.0.0.1 at start; a peer is
ready once ModelReady answers true for every model; stopping one ends its whole process group
(MLServer runs inference in a worker process of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from bench.lib.procfs import tree_cpu_seconds
from bench.processes import ROOT, ServerProcess
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kgrpc

PEERS = ("kserve", "mlserver")
PEERS_VENV = ROOT / ".cache" / "peers-venv"
SCRIPTS = ROOT / "bench" / "peers"
HOST = "127.0.0.1"


class PeerProcess(ServerProcess):
    """A peer server: its CPU time counts every process it started, and stop() ends them all."""

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.pid)

    def stop(self) -> None:
        if self.proc is None:
            return
        super().stop()
        # Its own session (ServerProcess.spawn): the group holds whatever it started.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def peer_bin(peer: str, program: str) -> Path:
    path = PEERS_VENV / peer / "bin" / program
    if not path.exists():
        raise RuntimeError(f"{path} is missing: run `make bench-peers` first")
    return path


def peer_process(peer: str, repository: Path, workdir: Path, prefix: Sequence[str]) -> PeerProcess:
    """The peer's server over `repository` (<model>/1/model.onnx), not yet started."""
    if peer == "kserve":
        argv = [
            *prefix,
            str(peer_bin(peer, "python")),
            str(SCRIPTS / "kserve_server.py"),
            str(repository),
            *("--grpc_port", str(free_port()), "--http_port", str(free_port())),
        ]
        return PeerProcess(peer, argv, workdir, re.compile(r"Starting gRPC server on \S+:(\d+)"))
    if peer == "mlserver":
        folder = workdir / "mlserver"
        folder.mkdir()
        shutil.copy(SCRIPTS / "mlserver_runtime.py", folder)
        ports = {name: free_port() for name in ("http_port", "grpc_port", "metrics_port")}
        (folder / "settings.json").write_text(json.dumps({"host": HOST, **ports}, indent=2))
        for path in sorted(repository.glob("*/1/model.onnx")):
            name = path.parent.parent.name
            (folder / name).mkdir()
            settings = {
                "name": name,
                "implementation": "mlserver_runtime.OnnxRuntimeModel",
                "parameters": {"uri": str(path)},
            }
            (folder / name / "model-settings.json").write_text(json.dumps(settings, indent=2))
        argv = [*prefix, str(peer_bin(peer, "mlserver")), "start", str(folder)]
        ready = re.compile(r"gRPC server running on http://[^:]+:(\d+)")
        return PeerProcess(peer, argv, workdir, ready, folder)
    raise ValueError(f"unknown peer {peer!r} (known: {', '.join(PEERS)})")


async def wait_models_ready(server: ServerProcess, models: Sequence[str], timeout_s: float = 120.0) -> None:
    """Waits until the server's KServe ModelReady says true for every model (its port is known)."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(f"{HOST}:{server.port}") as channel:
        stub = kgrpc.GRPCInferenceServiceStub(channel)
        pending = list(models)
        while pending:
            try:
                reply = await stub.ModelReady(kpb.ModelReadyRequest(name=pending[0]), timeout=2.0)
                if reply.ready:
                    pending.pop(0)
                    continue
            except grpc.aio.AioRpcError:
                pass
            if server.proc is not None and server.proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited:\n{server.log_tail()}")
            if time.monotonic() > deadline:
                late = f"{server.name}: {pending[0]} not ready in {timeout_s:.0f} s"
                raise RuntimeError(f"{late}\n{server.log_tail()}")
            await asyncio.sleep(0.1)
