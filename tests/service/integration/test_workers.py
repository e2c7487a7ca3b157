"""Worker processes (`--workers N`): one service to the outside. Requests spread over workers and
one scrape sums them (counters do not go back when a worker restarts); explicit model control
reaches every worker; KServe readiness answers for every worker; a killed worker is restarted
while the others serve on; a version swap under load fails no request; shared-memory regions
registered through one worker serve on any."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from multiprocessing import shared_memory
from pathlib import Path
from urllib.request import urlopen

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from models import demo_models
from modelyard.common import headers
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import model_service_pb2 as model_pb
from modelyard.inference.v1 import model_service_pb2_grpc as model_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kgrpc
from modelyard.tensors import to_tensor
from tests.support import REPO_ROOT, ServiceProcess, eventually, metric, start_child

CHANNELS = 16  # connections; SO_REUSEPORT spreads them by hash: all on one of 2 workers is 2**-15
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
X = np.ones((1, 4), np.float32)


@pytest.fixture
def small_repository(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    demo_models.write_model(root, "double", 1, demo_models.scaled_identity(4, 2.0), {"max_batch_size": 8})
    return root


def infer_request(model: str = "double") -> pb.InferRequest:
    return pb.InferRequest(model_name=model, inputs=[to_tensor("INPUT0", X)])


@asynccontextmanager
async def connections(address: str, count: int = CHANNELS) -> AsyncIterator[list[grpc.aio.Channel]]:
    # A local subchannel pool: each channel its own TCP connection, so the kernel spreads them.
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(count)
    ]
    try:
        yield channels
    finally:
        await asyncio.gather(*(c.close(None) for c in channels))


async def served_by(channel: grpc.aio.Channel, model: str = "double") -> str:
    call = pb_grpc.InferenceServiceStub(channel).Infer(infer_request(model))
    await call
    # A unary answer: beside x-served-version, in the trailing metadata.
    return str(dict(await call.trailing_metadata())["x-served-by"])


async def by_worker(channels: list[grpc.aio.Channel]) -> dict[str, list[grpc.aio.Channel]]:
    workers: dict[str, list[grpc.aio.Channel]] = {}
    for channel in channels:
        workers.setdefault(await served_by(channel), []).append(channel)
    return workers


def scrape(process: ServiceProcess) -> str:
    assert process.metrics_url is not None
    with urlopen(process.metrics_url, timeout=10) as reply:
        return str(reply.read().decode())


def pids(process: ServiceProcess) -> dict[int, int]:
    """Worker index -> pid of its latest start, from the supervisor's log."""
    found: dict[int, int] = {}
    for line in list(process.log):
        if m := re.search(r"worker (\d+) started \(pid (\d+)\)", line):
            found[int(m.group(1))] = int(m.group(2))
    return found


async def test_requests_spread_over_workers_and_one_scrape_sums_them(
    service_process, small_repository: Path
) -> None:
    process = service_process(small_repository, "--workers", "2")
    async with connections(process.address) as channels:
        seen = Counter[str]()
        for _ in range(3):
            for channel in channels:
                seen[await served_by(channel)] += 1
        assert set(seen) == {"worker-0", "worker-1"}, seen
        # KServe statistics sum the workers too, whichever worker answers.
        for channel in channels[:2]:
            stats = await kgrpc.GRPCInferenceServiceStub(channel).ModelStatistics(
                kpb.ModelStatisticsRequest(name="double")
            )
            assert [s.inference_count for s in stats.model_stats] == [3 * CHANNELS]
        text = scrape(process)
    # One scrape: the workers' request series summed, and each worker's own count beside them.
    assert metric(
        text, "modelyard_requests_total", method="Infer", model="double", version="1", code="OK"
    ) == (3 * CHANNELS)
    for worker, count in seen.items():
        index = worker.removeprefix("worker-")
        assert (metric(text, "modelyard_worker_requests", worker=index) or 0) >= count
    assert metric(text, "modelyard_workers_serving") == 2
    # Summed, not counted twice: a state gauge reads as on any one worker.
    assert metric(text, "modelyard_model_versions_ready", model="double") == 1


async def test_explicit_load_and_unload_reach_every_worker(service_process, small_repository: Path) -> None:
    process = service_process(
        small_repository,
        "--workers",
        "2",
        "--control-mode",
        "explicit",
        "--load-model",
        "*",
        "--management-open",
    )
    async with connections(process.address) as channels:
        workers = await by_worker(channels)
        assert len(workers) == 2
        control = model_grpc.ModelServiceStub(channels[0])
        unloaded = await control.UnloadModel(model_pb.UnloadModelRequest(name="double"))
        assert [v.state for v in unloaded.model.versions] == [model_pb.MODEL_STATE_UNLOADED]
        # Already applied on every worker when the call returned: no waiting.
        for channel in channels:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await pb_grpc.InferenceServiceStub(channel).Infer(infer_request())
            assert failed.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)
        loaded = await model_grpc.ModelServiceStub(channels[-1]).LoadModel(
            model_pb.LoadModelRequest(name="double")
        )
        assert [v.state for v in loaded.model.versions] == [model_pb.MODEL_STATE_READY]
        for channel in channels:
            await pb_grpc.InferenceServiceStub(channel).Infer(infer_request())
        # A failure names the worker and fails the call as a whole.
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await control.LoadModel(model_pb.LoadModelRequest(name="nope"))
        assert failed.value.code() == grpc.StatusCode.NOT_FOUND
        assert re.match(r"worker \d: ", failed.value.details() or "")
        # Every worker answers the same for the model.
        answers = {
            (await model_grpc.ModelServiceStub(c).GetModel(model_pb.GetModelRequest(name="double")))
            .model.versions[0]
            .state
            for c in channels
        }
        assert answers == {model_pb.MODEL_STATE_READY}


async def test_model_control_through_workers_needs_a_credential(
    service_process, small_repository: Path, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    process = service_process(
        small_repository,
        "--workers",
        "2",
        "--control-mode",
        "explicit",
        "--load-model",
        "*",
        "--auth-tokens-file",
        str(tokens),
    )
    async with connections(process.address, 4) as channels:
        control = model_grpc.ModelServiceStub(channels[0])
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await control.UnloadModel(model_pb.UnloadModelRequest(name="double"))
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for channel in channels:  # the refused call changed nothing on any worker
            await pb_grpc.InferenceServiceStub(channel).Infer(infer_request())
        await control.UnloadModel(
            model_pb.UnloadModelRequest(name="double"), metadata=[("authorization", "Bearer s3cret")]
        )
        for channel in channels:
            with pytest.raises(grpc.aio.AioRpcError):
                await pb_grpc.InferenceServiceStub(channel).Infer(infer_request())


async def test_a_killed_worker_restarts_while_the_others_serve(
    service_process, small_repository: Path
) -> None:
    process = service_process(small_repository, "--workers", "2")
    async with connections(process.address) as channels:
        workers = await by_worker(channels)
        assert set(workers) == {"worker-0", "worker-1"}
        survivors = workers["worker-1"]
        failures: list[BaseException] = []
        answered = 0
        stop = asyncio.Event()

        async def load(channel: grpc.aio.Channel) -> None:
            nonlocal answered
            stub = pb_grpc.InferenceServiceStub(channel)
            while not stop.is_set():
                try:
                    await stub.Infer(infer_request())
                    answered += 1
                except grpc.aio.AioRpcError as exc:
                    failures.append(exc)

        statuses: list[int] = []

        async def watch_health() -> None:
            async for reply in health_pb2_grpc.HealthStub(survivors[0]).Watch(
                health_pb2.HealthCheckRequest()
            ):
                statuses.append(reply.status)

        watching = asyncio.ensure_future(watch_health())
        await eventually(lambda: statuses == [SERVING], "the whole service serving")
        tasks = [asyncio.ensure_future(load(c)) for c in survivors]
        victim = pids(process)[0]
        os.kill(victim, signal.SIGKILL)
        await eventually(lambda: pids(process).get(0, victim) != victim, "worker 0 restarted")
        await eventually(
            lambda: sum("worker 0 admitted" in line for line in process.log) == 2, "worker 0 admitted again"
        )
        before = answered
        await eventually(lambda: answered > before + 10, "requests after the restart")
        stop.set()
        await asyncio.gather(*tasks)
        assert failures == []  # not one request failed on the surviving worker's connections
        assert any("worker 0 (pid" in line and "restarting it in" in line for line in process.log)
        assert metric(scrape(process), "modelyard_worker_restarts_total", worker="0") == 1
        # A survivor said NOT_SERVING while a worker was missing, and SERVING once all were back.
        await eventually(lambda: statuses[-1] == SERVING and NOT_SERVING in statuses, "health back")
        watching.cancel()
    assert process.stop() == 0  # SIGTERM: every worker drains, the supervisor exits cleanly
    assert sum("stopped (exit code 0)" in line for line in process.log) == 2


async def test_workers_do_not_outlive_a_killed_supervisor(service_process, small_repository: Path) -> None:
    # SIGKILL: the supervisor stops nothing itself; each worker's parent-death signal stops it.
    process = service_process(small_repository, "--workers", "2")
    workers = list(pids(process).values())
    assert len(workers) == 2 and all(_running(pid) for pid in workers)
    try:
        process.stop(signal.SIGKILL)
        await eventually(lambda: not any(_running(pid) for pid in workers), "the workers gone")
    finally:
        for pid in workers:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigterm_stops_idle_workers_without_waiting_out_the_grace(
    service_process, small_repository: Path
) -> None:
    # The supervisor's own streams into each worker (health, model state) are no calls to drain.
    process = service_process(small_repository, "--workers", "2", "--grace-s", "60")
    started = time.monotonic()
    assert process.stop(timeout=90) == 0
    assert time.monotonic() - started < 30
    assert sum("worker" in line and "stopped (exit code 0)" in line for line in process.log) == 2


def _pid_namespaces() -> bool:
    try:
        return subprocess.run(["unshare", "-pf", "--mount-proc", "true"], timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not _pid_namespaces(), reason="needs unshare and a new PID namespace (root)")
def test_a_supervisor_that_is_pid_1_starts_its_workers(small_repository: Path) -> None:
    # In a container the supervisor is PID 1, so a worker's parent pid of 1 is no sign of an orphan.
    # unshare passes no signal on; killed, it SIGKILLs its child (--kill-child), PID 1 of the new
    # namespace, and with that the kernel kills every process in it.
    cmd = ["unshare", "-pf", "--mount-proc", "--kill-child", sys.executable, "-m", "modelyard.service"]
    cmd += ["--repository", str(small_repository), "--listen", "127.0.0.1:0", "--metrics-listen", ""]
    process = start_child([*cmd, "--workers", "2"], re.compile(r"serving gRPC on (\S+?)[,;]"), "service")
    try:
        # The ready line itself: a worker's own line may already follow it in the log.
        assert "workers: 2" in process.ready.string
    finally:
        process.stop(signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


async def restarted(process: ServiceProcess, index: int = 0) -> None:
    """Kill worker `index` and wait until its replacement is admitted."""
    victim = pids(process)[index]
    admitted = sum(f"worker {index} admitted" in line for line in process.log)
    os.kill(victim, signal.SIGKILL)
    await eventually(lambda: pids(process).get(index, victim) != victim, f"worker {index} restarted")
    await eventually(
        lambda: sum(f"worker {index} admitted" in line for line in process.log) > admitted,
        f"worker {index} admitted again",
    )


async def readiness(channel: grpc.aio.Channel) -> tuple[list[tuple[str, str, str]], bool, list[int]]:
    """What KServe's RepositoryIndex and ModelReady and our ListModels say of `double`."""
    kserve = kgrpc.GRPCInferenceServiceStub(channel)
    index = await kserve.RepositoryIndex(kpb.RepositoryIndexRequest())
    ready = await kserve.ModelReady(kpb.ModelReadyRequest(name="double"))
    listed = await model_grpc.ModelServiceStub(channel).ListModels(model_pb.ListModelsRequest())
    return (
        [(m.name, m.version, m.state) for m in index.models],
        ready.ready,
        [v.state for m in listed.models if m.name == "double" for v in m.versions],
    )


async def test_kserve_readiness_answers_for_every_worker(service_process, small_repository: Path) -> None:
    process = service_process(
        small_repository,
        "--workers",
        "2",
        "--control-mode",
        "explicit",
        "--load-model",
        "*",
        "--management-open",
    )
    ready, unloaded = model_pb.MODEL_STATE_READY, model_pb.MODEL_STATE_UNLOADED
    async with connections(process.address) as channels:
        workers = await by_worker(channels)
        assert set(workers) == {"worker-0", "worker-1"}
        first, second = workers["worker-0"][0], workers["worker-1"][0]
        for channel in (first, second):
            assert await readiness(channel) == ([("double", "1", "READY")], True, [ready])
        await model_grpc.ModelServiceStub(first).UnloadModel(model_pb.UnloadModelRequest(name="double"))
        for channel in (first, second):
            assert await readiness(channel) == ([("double", "1", "UNAVAILABLE")], False, [unloaded])
        await kgrpc.GRPCInferenceServiceStub(second).RepositoryModelLoad(
            kpb.RepositoryModelLoadRequest(model_name="double")
        )
        for channel in (first, second):
            assert await readiness(channel) == ([("double", "1", "READY")], True, [ready])
    # Workers disagree: the model's files are gone (explicit mode: the workers do not look), and
    # worker 0 comes back without it (replaying the load fails), while worker 1 still serves it.
    shutil.rmtree(small_repository / "double")
    await restarted(process, 0)
    assert any("worker 0: replaying" in line and "failed" in line for line in process.log)
    async with connections(process.address) as channels:
        answered: Counter[bool] = Counter()
        for channel in channels:
            try:
                await pb_grpc.InferenceServiceStub(channel).Infer(infer_request())
                answered[True] += 1
            except grpc.aio.AioRpcError:
                answered[False] += 1
        assert answered[True] and answered[False], answered  # one worker serves it, one does not
        for channel in channels:  # whichever worker answers: not ready, as in ListModels
            index, model_ready, states = await readiness(channel)
            assert index == [("double", "1", "LOADING")]
            assert model_ready is False
            assert ready not in states
            ready_index = await kgrpc.GRPCInferenceServiceStub(channel).RepositoryIndex(
                kpb.RepositoryIndexRequest(ready=True)
            )
            assert list(ready_index.models) == []


async def test_kserve_server_ready_needs_every_worker(
    service_process, small_repository: Path, tmp_path: Path
) -> None:
    process = service_process(
        small_repository, "--workers", "2", "--control-mode", "explicit", "--load-model", "*"
    )
    async with connections(process.address) as channels:
        workers = await by_worker(channels)
        survivor = kgrpc.GRPCInferenceServiceStub(workers["worker-1"][0])
        assert (await survivor.ServerReady(kpb.ServerReadyRequest())).ready
        # Worker 0 cannot start again while its repository is away: the service is not whole.
        away = tmp_path / "away"
        os.rename(small_repository, away)
        victim = pids(process)[0]
        os.kill(victim, signal.SIGKILL)
        await eventually(
            lambda: sum("worker 0 (pid" in line and "exited" in line for line in process.log) >= 2,
            "worker 0 failing to start",
        )
        health = health_pb2_grpc.HealthStub(workers["worker-1"][0])
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == NOT_SERVING
        assert not (await survivor.ServerReady(kpb.ServerReadyRequest())).ready
        await pb_grpc.InferenceServiceStub(workers["worker-1"][0]).Infer(infer_request())  # still serves
        os.rename(away, small_repository)
        await eventually(
            lambda: sum("worker 0 admitted" in line for line in process.log) == 2, "worker 0 back"
        )

        async def whole() -> bool:
            return (await survivor.ServerReady(kpb.ServerReadyRequest())).ready

        await eventually(whole, "ServerReady once every worker serves")


async def test_counters_do_not_go_back_when_a_worker_restarts(
    service_process, small_repository: Path
) -> None:
    process = service_process(small_repository, "--workers", "2")

    def requests(text: str) -> float:
        labels = {"method": "Infer", "model": "double", "version": "1", "code": "OK"}
        return metric(text, "modelyard_requests_total", **labels) or 0.0

    async with connections(process.address) as channels:
        workers = await by_worker(channels)
        assert set(workers) == {"worker-0", "worker-1"}
        for channel in channels:
            await served_by(channel)
        before = scrape(process)
    total = requests(before)
    assert total == 2 * CHANNELS
    assert (metric(before, "modelyard_worker_requests", worker="0") or 0) > 0  # worker 0 counted some
    assert not re.search(r"^modelyard_requests_created", before, re.M)  # no summed timestamps
    await restarted(process, 0)
    after = scrape(process)
    assert requests(after) == total  # worker 0's requests are carried, not lost
    async with connections(process.address) as channels:
        for channel in channels:
            await served_by(channel)
    assert requests(scrape(process)) == total + CHANNELS


async def test_a_version_swap_under_load_fails_no_request(service_process, small_repository: Path) -> None:
    process = service_process(small_repository, "--workers", "2", "--watch-quiet-s", "0.1")
    async with connections(process.address) as channels:
        workers = await by_worker(channels)
        assert set(workers) == {"worker-0", "worker-1"}
        for first, *_ in workers.values():  # each worker passes on the merged watch's count
            initial = model_grpc.ModelServiceStub(first).WatchModels(
                model_pb.WatchModelsRequest(send_initial_state=True)
            )
            assert dict(await initial.initial_metadata())[headers.INITIAL_STATE_COUNT] == "1"
            first_event = await initial.read()
            assert isinstance(first_event, model_pb.WatchModelsResponse)
            assert first_event.model_name == "double"
            initial.cancel()
        failures: list[BaseException] = []
        versions: Counter[str] = Counter()
        stop = asyncio.Event()
        events: dict[str, list[tuple[str, int]]] = {"worker-0": [], "worker-1": []}
        ready_two = {name: asyncio.Event() for name in events}

        async def watch(worker: str) -> None:
            stub = model_grpc.ModelServiceStub(workers[worker][0])
            async for event in stub.WatchModels(model_pb.WatchModelsRequest(names=["double"])):
                events[worker].append((event.version, event.state))
                if (event.version, event.state) == ("2", model_pb.MODEL_STATE_READY):
                    ready_two[worker].set()

        async def load(channel: grpc.aio.Channel) -> None:
            stub = pb_grpc.InferenceServiceStub(channel)
            while not stop.is_set():
                try:
                    reply = await stub.Infer(infer_request())
                    versions[reply.model_version] += 1
                except grpc.aio.AioRpcError as exc:
                    failures.append(exc)

        watchers = [asyncio.ensure_future(watch(name)) for name in events]
        tasks = [asyncio.ensure_future(load(c)) for c in channels]
        await eventually(lambda: versions["1"] > 20, "load on version 1")
        demo_models.write_model(small_repository, "double", 2, demo_models.scaled_identity(4, 3.0))
        # The merged watch says READY for version 2 once every worker serves it, on any worker.
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in ready_two.values())), 60)
        model = (
            await model_grpc.ModelServiceStub(channels[0]).GetModel(model_pb.GetModelRequest(name="double"))
        ).model
        assert model.default_version == "2"
        for channel in channels:  # every connection, whichever worker, answers with version 2 now
            assert (await pb_grpc.InferenceServiceStub(channel).Infer(infer_request())).model_version == "2"
        before = versions["2"]
        await eventually(lambda: versions["2"] > before + 20, "load on version 2")
        stop.set()
        await asyncio.gather(*tasks)
        for watcher in watchers:
            watcher.cancel()
        assert failures == []
        assert events["worker-0"] == events["worker-1"]  # one service: the same events from either


async def test_shared_memory_registered_through_one_worker_serves_on_any(
    service_process, small_repository: Path
) -> None:
    process = service_process(small_repository, "--workers", "2", "--management-open")
    block = shared_memory.SharedMemory(f"modelyard_workers_{os.getpid()}", create=True, size=64)
    try:
        np.ndarray((1, 4), np.float32, buffer=block.buf)[:] = [[1, 2, 3, 4]]
        async with connections(process.address) as channels:
            workers = await by_worker(channels)
            first, second = workers["worker-0"][0], workers["worker-1"][0]
            await kgrpc.GRPCInferenceServiceStub(first).SystemSharedMemoryRegister(
                kpb.SystemSharedMemoryRegisterRequest(name="in", key=f"/{block.name}", offset=0, byte_size=16)
            )
            status = await kgrpc.GRPCInferenceServiceStub(second).SystemSharedMemoryStatus(
                kpb.SystemSharedMemoryStatusRequest()
            )
            assert list(status.regions) == ["in"]
            request = kpb.ModelInferRequest(model_name="double")
            tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
            tensor.parameters["shared_memory_region"].string_param = "in"
            tensor.parameters["shared_memory_byte_size"].int64_param = 16
            reply = await kgrpc.GRPCInferenceServiceStub(second).ModelInfer(request)
            assert np.frombuffer(reply.raw_output_contents[0], np.float32).tolist() == [2, 4, 6, 8]
            await kgrpc.GRPCInferenceServiceStub(second).SystemSharedMemoryUnregister(
                kpb.SystemSharedMemoryUnregisterRequest(name="in")
            )
    finally:
        block.close()
        block.unlink()


def test_a_taken_port_fails_loudly(small_repository: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MODELYARD_")}
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "modelyard.service",
                "--repository",
                str(small_repository),
                "--listen",
                f"127.0.0.1:{port}",
                "--metrics-listen",
                "",
                "--workers",
                "2",
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO_ROOT,
            timeout=60,
        )
    # One line naming the flag, its variable and the value (tests/stack/integration/test_startup_errors.py).
    assert done.returncode == 2
    assert f"--listen: cannot listen on '127.0.0.1:{port}': address already in use" in done.stderr
    assert "MODELYARD_SERVICE_LISTEN" in done.stderr
    assert "worker 0 started" not in done.stderr
