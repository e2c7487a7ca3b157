"""`python -m modelyard.sidecar --workers 2` in front of a real service, as an operator runs it:
calls on separate connections spread over both workers, one scrape sums them, an admin weight
change reaches every worker (whichever worker answers a call, it routes by the new weight), a
killed worker is restarted and gets the changes replayed, and a taken port fails loudly."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.tensors import to_tensor
from tests.sidecar_support import SidecarProcess
from tests.support import ServiceProcess, eventually, metric

CONNECTIONS = 16  # separate connections: the kernel spreads connections, not calls, over workers


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return str(answer.read().decode())


def put(url: str, body: object) -> dict[str, object]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="PUT")
    with urllib.request.urlopen(request, timeout=10) as answer:
        return dict(json.loads(answer.read()))


def total(text: str, name: str, **labels: str) -> float:
    """The sum of a family's samples whose labels include `labels`."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


async def served_versions(address: str) -> list[str]:
    """One Infer of scaler on each of CONNECTIONS fresh connections: the version that answered."""
    x = np.full((1, 16), 1.0, np.float32)
    request = pb.InferRequest(model_name="scaler", inputs=[to_tensor("INPUT0", x)])
    versions = []
    for _ in range(CONNECTIONS):
        # A local subchannel pool: a connection of its own (channels otherwise share one).
        options = [("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            answer = await pb_grpc.InferenceServiceStub(channel).Infer(request, timeout=30)
            versions.append(answer.model_version)
    return versions


def worker_pid(sidecar: SidecarProcess, index: int, other_than: int = 0) -> int | None:
    pattern = re.compile(rf"worker {index} started \(pid (\d+)\)")
    pids = [int(m.group(1)) for line in list(sidecar.log) if (m := pattern.search(line))]
    fresh = [pid for pid in pids if pid != other_than]
    return fresh[-1] if fresh else None


async def test_two_workers_spread_sum_take_changes_and_restart(
    tmp_path: Path,
    service_process: Callable[..., ServiceProcess],
    sidecar_process: Callable[..., SidecarProcess],
) -> None:
    repository = tmp_path / "models"
    demo_models.build_demo_repository(repository)  # scaler serves versions 1 and 2
    upstream = service_process(repository)
    sidecar = sidecar_process("--upstream", upstream.address, "--workers", "2", admin_open=True)
    assert sidecar.admin_url is not None
    admin = sidecar.admin_url

    # One route for every worker: stable 1, canary 2 at 0, then at 100. Right after start: the
    # supervisor asks the first worker again while its upstream has not reported its models yet.
    answer = await asyncio.to_thread(put, f"{admin}/canary/scaler", {"stable": "1", "canary": "2"})
    assert answer["canary_weight"] == 0
    assert set(await served_versions(sidecar.address)) == {"1"}
    answer = await asyncio.to_thread(put, f"{admin}/canary/scaler", {"canary_weight": 100})
    assert answer["canary_weight"] == 100
    assert set(await served_versions(sidecar.address)) == {"2"}

    # Both workers answered calls, and the one scrape sums them.
    text = await asyncio.to_thread(get, f"{admin}/metrics")
    spread = [metric(text, "modelyard_sidecar_worker_requests", worker=str(i)) for i in (0, 1)]
    assert all(n is not None and n > 0 for n in spread), spread
    assert total(text, "modelyard_sidecar_requests_total", model="scaler") == 2 * CONNECTIONS
    assert sum(n or 0 for n in spread) == 2 * CONNECTIONS
    canary = json.loads(await asyncio.to_thread(get, f"{admin}/canary"))
    assert canary["models"]["scaler"]["canary_weight"] == 100
    breakers = json.loads(await asyncio.to_thread(get, f"{admin}/breakers"))
    assert breakers and all(set(b["workers"]) == {"0", "1"} for b in breakers)

    # A killed worker is restarted, with the weight change replayed to it.
    first = worker_pid(sidecar, 0)
    assert first is not None
    os.kill(first, signal.SIGKILL)
    await eventually(lambda: worker_pid(sidecar, 0, other_than=first) is not None, "worker 0 restarted")

    async def restarted() -> bool:
        text = await asyncio.to_thread(get, f"{admin}/metrics")
        return (
            metric(text, "modelyard_sidecar_worker_restarts_total", worker="0") == 1
            and metric(text, "modelyard_sidecar_workers_serving") == 2
        )

    await eventually(restarted, "worker 0 serving again")
    versions = await served_versions(sidecar.address)
    assert set(versions) == {"2"}, versions
    text = await asyncio.to_thread(get, f"{admin}/metrics")
    # The dead worker's counts are carried over: the sum does not go back.
    assert total(text, "modelyard_sidecar_requests_total", model="scaler") == 3 * CONNECTIONS
    assert sidecar.stop() == 0


def test_a_taken_port_fails_loudly() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MODELYARD_")}
        done = subprocess.run(
            [sys.executable, "-m", "modelyard.sidecar", "--workers", "2", "--listen", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    assert done.returncode == 2, done.stderr
    assert "listen" in done.stderr and str(port) in done.stderr


def test_the_supervisors_admin_endpoint_asks_for_its_tokens(
    tmp_path: Path, sidecar_process: Callable[..., SidecarProcess]
) -> None:
    tokens, routes = tmp_path / "tokens", tmp_path / "routes.yaml"
    tokens.write_text("s3cret-token-for-the-test\n")
    routes.write_text("models: {scaler: {canary_weight: 10}}\n")
    sidecar = sidecar_process(
        "--upstream",
        "127.0.0.1:9",
        "--config",
        str(routes),
        "--admin-tokens-file",
        str(tokens),
        "--workers",
        "2",
    )
    url = f"{sidecar.admin_url}/canary/scaler"
    body = json.dumps({"canary_weight": 30}).encode()
    refused = urllib.request.Request(url, data=body, method="PUT")
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(refused, timeout=10)
    assert denied.value.code == 401
    allowed = urllib.request.Request(
        url, data=body, method="PUT", headers={"Authorization": "Bearer s3cret-token-for-the-test"}
    )
    with urllib.request.urlopen(allowed, timeout=10) as answer:
        assert json.loads(answer.read())["canary_weight"] == 30
    canary = json.loads(get(f"{sidecar.admin_url}/canary"))
    assert canary["models"]["scaler"]["canary_weight"] == 30
    text = get(f"{sidecar.admin_url}/metrics")
    assert metric(text, "modelyard_sidecar_admin_denials_total", outcome="unauthenticated") == 1
