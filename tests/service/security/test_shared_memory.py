"""System shared memory under a hostile owner: a region's object shrunk after registration must
not crash the service (a mapped read past the new end is SIGBUS), registrations are bounded, and a
region serves only the caller who registered it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from models import demo_models
from modelyard.common.headers import ERROR_REASON
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kpb_grpc
from tests.support import ServiceProcess

FEATURES = 4
NBYTES = FEATURES * 4  # one float32 row


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    demo_models.write_model(root, "scaler", 1, demo_models.scaled_identity(FEATURES, 2.0))
    return root


@pytest.fixture
def shm_object() -> Iterator[tuple[str, int]]:
    """A POSIX shared memory object of 4 KiB (key, descriptor), as a local client makes one."""
    name = f"modelyard_sec_{os.getpid()}"
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4096)
        yield "/" + name, fd
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/{name}")


def _shm_param(request_tensor: object, region: str, size: int) -> None:
    parameters = request_tensor.parameters  # type: ignore[attr-defined]
    parameters["shared_memory_region"].string_param = region
    parameters["shared_memory_byte_size"].int64_param = size


def _infer(input_region: str | None, output_region: str | None) -> kpb.ModelInferRequest:
    request = kpb.ModelInferRequest(model_name="scaler")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, FEATURES])
    if input_region is not None:
        _shm_param(tensor, input_region, NBYTES)
    else:
        request.raw_input_contents.append(np.ones(FEATURES, np.float32).tobytes())
    if output_region is not None:
        _shm_param(request.outputs.add(name="OUTPUT0"), output_region, NBYTES)
    return request


def _reason(error: grpc.aio.AioRpcError) -> object:
    trailers: Any = error.trailing_metadata() or ()
    return dict(trailers).get(ERROR_REASON)


async def test_a_region_shrunk_under_its_registration_is_invalid_argument_not_a_crash(
    root: Path, shm_object: tuple[str, int], service_process: Callable[..., ServiceProcess]
) -> None:
    key, fd = shm_object
    process = service_process(root, "--management-open")
    async with grpc.aio.insecure_channel(process.address) as channel:
        stub = kpb_grpc.GRPCInferenceServiceStub(channel)
        await stub.SystemSharedMemoryRegister(
            kpb.SystemSharedMemoryRegisterRequest(name="in", key=key, offset=0, byte_size=2048)
        )
        await stub.SystemSharedMemoryRegister(
            kpb.SystemSharedMemoryRegisterRequest(name="out", key=key, offset=2048, byte_size=2048)
        )
        os.pwrite(fd, np.full(FEATURES, 3.0, np.float32).tobytes(), 0)
        answer = await stub.ModelInfer(_infer("in", "out"), timeout=10)
        assert answer.raw_output_contents[0] == b""
        assert np.frombuffer(os.pread(fd, NBYTES, 2048), np.float32).tolist() == [6.0] * FEATURES

        os.ftruncate(fd, 0)  # the owner shrinks the object under both registrations
        for request, region in ((_infer("in", None), "'in'"), (_infer(None, "out"), "'out'")):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ModelInfer(request, timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
            assert _reason(caught.value) == "invalid_argument"
            assert f"region {region} is shorter than registered" in (caught.value.details() or "")
        # Alive, and a plain call answers.
        plain = await stub.ModelInfer(_infer(None, None), timeout=10)
        assert np.frombuffer(plain.raw_output_contents[0], np.float32).tolist() == [2.0] * FEATURES
        assert process.proc.poll() is None


async def test_registrations_are_bounded_in_number_and_bytes(
    root: Path, shm_object: tuple[str, int], service_process: Callable[..., ServiceProcess]
) -> None:
    key, _ = shm_object
    process = service_process(root, "--management-open", "--shm-max-regions", "2", "--shm-max-bytes", "3000")
    async with grpc.aio.insecure_channel(process.address) as channel:
        stub = kpb_grpc.GRPCInferenceServiceStub(channel)

        async def register(name: str, size: int) -> None:
            await stub.SystemSharedMemoryRegister(
                kpb.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=0, byte_size=size)
            )

        await register("a", 2000)
        refusals = (
            ("b", 2000, grpc.StatusCode.RESOURCE_EXHAUSTED, "too_large", "limit is 3000"),
            ("x" * 5000, 8, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", "at most 128"),
        )
        for name, size, code, reason, what in refusals:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await register(name, size)
            details = caught.value.details() or ""
            assert (caught.value.code(), _reason(caught.value)) == (code, reason), details
            assert what in details and len(details) < 400, details
        await register("b", 1000)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await register("c", 1)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _reason(caught.value) == "too_large"
        assert "limit is 2" in (caught.value.details() or "")
        # Unregistering gives the room back.
        await stub.SystemSharedMemoryUnregister(kpb.SystemSharedMemoryUnregisterRequest(name="a"))
        await register("c", 1)


async def test_a_region_is_used_only_by_whoever_registered_it(
    root: Path, tmp_path: Path, shm_object: tuple[str, int], service_process: Callable[..., ServiceProcess]
) -> None:
    # Management (registering) needs a management token; inference is open. Alice registers a region
    # over her object; Mallory, with a valid token of her own, and an anonymous caller can neither
    # read it (as an input), overwrite it (as an output), list it nor unregister it.
    key, fd = shm_object
    tokens = tmp_path / "tokens"
    tokens.write_text("alice-token\nmallory-token\n")
    process = service_process(root, "--auth-tokens-file", str(tokens))
    alice, mallory = ((("authorization", f"Bearer {who}-token"),) for who in ("alice", "mallory"))
    secret = np.full(FEATURES, 7.0, np.float32).tobytes()
    os.pwrite(fd, secret, 0)
    async with grpc.aio.insecure_channel(process.address) as channel:
        stub = kpb_grpc.GRPCInferenceServiceStub(channel)
        register = kpb.SystemSharedMemoryRegisterRequest(name="mine", key=key, offset=0, byte_size=2048)
        with pytest.raises(grpc.aio.AioRpcError) as anonymous:
            await stub.SystemSharedMemoryRegister(register)
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await stub.SystemSharedMemoryRegister(register, metadata=alice)
        for metadata in (mallory, ()):
            for request in (_infer("mine", None), _infer(None, "mine")):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.ModelInfer(request, metadata=metadata, timeout=10)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "no system shared memory region 'mine' is registered" in (caught.value.details() or "")
        status = await stub.SystemSharedMemoryStatus(kpb.SystemSharedMemoryStatusRequest(), metadata=mallory)
        assert dict(status.regions) == {}
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SystemSharedMemoryStatus(
                kpb.SystemSharedMemoryStatusRequest(name="mine"), metadata=mallory
            )
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        await stub.SystemSharedMemoryUnregister(kpb.SystemSharedMemoryUnregisterRequest(), metadata=mallory)
        await stub.SystemSharedMemoryUnregister(
            kpb.SystemSharedMemoryUnregisterRequest(name="mine"), metadata=mallory
        )
        assert os.pread(fd, NBYTES, 0) == secret  # nothing was written over
        # Alice's region is still registered and serves her.
        status = await stub.SystemSharedMemoryStatus(kpb.SystemSharedMemoryStatusRequest(), metadata=alice)
        assert list(status.regions) == ["mine"]
        answer = await stub.ModelInfer(_infer("mine", None), metadata=alice, timeout=10)
        assert np.frombuffer(answer.raw_output_contents[0], np.float32).tolist() == [14.0] * FEATURES
