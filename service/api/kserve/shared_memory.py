"""Triton's system and CUDA shared-memory extensions: registering, listing and dropping regions
in the registry that the tensors read inputs from and write outputs into (kserve/tensors.py).
Each call acts on its caller's regions only (`owner`, service/shm/registry.py). CUDA regions are
refused: none can be registered."""

from __future__ import annotations

import asyncio
from functools import partial

from modelyard.common.names import echo
from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.service.errors import Unsupported
from modelyard.service.shm.registry import RegionNotFound, SharedMemoryRegistry

CUDA_SHM_REFUSAL = (
    "CUDA shared memory is not supported: this server does not import CUDA IPC handles (tensors "
    "reach ONNX Runtime from host memory); use system shared memory or inline tensors"
)


def system_status(
    registry: SharedMemoryRegistry, request: pb.SystemSharedMemoryStatusRequest, owner: str
) -> pb.SystemSharedMemoryStatusResponse:
    response = pb.SystemSharedMemoryStatusResponse()
    for spec in registry.status(request.name, owner=owner):
        response.regions[spec.name].CopyFrom(
            pb.SystemSharedMemoryStatusResponse.RegionStatus(
                name=spec.name, key=spec.key, offset=spec.offset, byte_size=spec.byte_size
            )
        )
    return response


async def system_register(
    registry: SharedMemoryRegistry, request: pb.SystemSharedMemoryRegisterRequest, owner: str
) -> pb.SystemSharedMemoryRegisterResponse:
    register = partial(registry.register, owner=owner)
    await asyncio.get_running_loop().run_in_executor(
        None, register, request.name, request.key, request.offset, request.byte_size
    )
    return pb.SystemSharedMemoryRegisterResponse()


def system_unregister(
    registry: SharedMemoryRegistry, request: pb.SystemSharedMemoryUnregisterRequest, owner: str
) -> pb.SystemSharedMemoryUnregisterResponse:
    registry.unregister(request.name, owner=owner)
    return pb.SystemSharedMemoryUnregisterResponse()


def cuda_status(request: pb.CudaSharedMemoryStatusRequest) -> pb.CudaSharedMemoryStatusResponse:
    if request.name:
        raise RegionNotFound(f"no CUDA shared memory region {echo(request.name)} is registered")
    return pb.CudaSharedMemoryStatusResponse()  # none can be registered


def cuda_register(request: pb.CudaSharedMemoryRegisterRequest) -> pb.CudaSharedMemoryRegisterResponse:
    raise Unsupported(CUDA_SHM_REFUSAL)


def cuda_unregister(request: pb.CudaSharedMemoryUnregisterRequest) -> pb.CudaSharedMemoryUnregisterResponse:
    return pb.CudaSharedMemoryUnregisterResponse()  # none is registered: nothing to do
