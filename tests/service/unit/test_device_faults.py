"""A device fault rests its instance while the others serve, and is counted.

No run on this machine's CPU raises a device error, so the classifier is tested on the messages
ONNX Runtime's CUDA provider makes, built from its own format strings (cuda_call.cc: "%s failure
%d: %s ; GPU=%d ; hostname=%s ; file=%s ; line=%d ; expr=%s; %s" for each library cuda_call.h
names, as 1.31.1's libonnxruntime_providers_cuda.so holds them; older builds' cuda_common.h:
"<LIB> error executing <call>"), wrapped as its Python binding raises them: Fail or
RuntimeException with "[ONNXRuntimeError] : <code> : <NAME> : ", or from a bound run
(run_with_iobinding) a plain RuntimeError "Error in execution: ...". Messages of real CPU failures
are not device faults."""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import pytest
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

from models import demo_models
from modelyard.service.errors import DeviceFault, InvalidInput, ModelRunError, RunMemoryExceeded
from modelyard.service.metrics import ServiceMetrics
from modelyard.service.runtime.instances import Instances
from modelyard.service.runtime.iobinding import UNTYPED_PREFIX, typed_failure
from modelyard.service.runtime.session import is_device_fault, run_error
from tests.batching_fakes import FakeRunner, FaultyRunner, HandClock
from tests.support import metric

# cuda_call.cc's format, and the library names cuda_call.h gives it (both as in the strings of
# onnxruntime-gpu 1.31.1's libonnxruntime_providers_cuda.so: CUDNN_FE is cuDNN's frontend API).
CUDA_CALL_FORMAT = "%s failure %d: %s ; GPU=%d ; hostname=%s ; file=%s ; line=%d ; expr=%s; %s"
LIBRARIES = ("CUDA", "CUBLAS", "CUSPARSE", "CURAND", "CUDNN", "CUDNN_FE", "CUFFT", "NCCL")
STATUS_PREFIX = "[ONNXRuntimeError] : 1 : FAIL : "
THROWN_PREFIX = "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : "
NODE = "Non-zero status code returned while running MatMul node. Name:'fc0' Status Message: "


def cuda_call(
    library: str = "CUDA", code: int = 700, text: str = "an illegal memory access was encountered"
) -> str:
    return CUDA_CALL_FORMAT % (
        library,
        code,
        text,
        0,
        "gpu-host",
        "/onnxruntime_src/onnxruntime/core/providers/cuda/gpu_data_transfer.cc",
        88,
        "cudaMemcpyAsync(dst, src, bytes, kind, stream)",
        "",
    )


def test_each_cuda_librarys_failure_is_a_device_fault_however_it_reaches_python() -> None:
    for library in LIBRARIES:
        message = cuda_call(library, 13, f"{library}_STATUS_EXECUTION_FAILED")
        for exc in (Fail(STATUS_PREFIX + NODE + message), RuntimeException(THROWN_PREFIX + message)):
            assert is_device_fault(exc), exc
            fault = run_error(exc, "model m version 1")
            assert isinstance(fault, DeviceFault) and "GPU=0" in str(fault)
        returned = f"{library} error executing cublasSgemm(handle, ...)"
        assert is_device_fault(Fail(STATUS_PREFIX + NODE + returned))
    assert is_device_fault(
        Fail(STATUS_PREFIX + "CUDA error cudaErrorIllegalAddress:an illegal memory access")
    )


def test_a_device_out_of_memory_is_the_runs_memory_bound_not_a_fault() -> None:
    # cudaMalloc's cudaErrorMemoryAllocation (2) and the libraries' allocation failures: the run
    # asked for too much, the device is fine; resting the instance would punish the next caller.
    for message in (
        cuda_call("CUDA", 2, "out of memory"),
        cuda_call("CUBLAS", 3, "CUBLAS_STATUS_ALLOC_FAILED"),
        cuda_call("CUDNN", 2, "CUDNN_STATUS_ALLOC_FAILED"),
    ):
        for exc in (Fail(STATUS_PREFIX + NODE + message), RuntimeException(THROWN_PREFIX + message)):
            assert not is_device_fault(exc), exc
            assert isinstance(run_error(exc, "model m version 1"), RunMemoryExceeded), exc


def test_failures_that_are_not_the_devices_are_not_device_faults() -> None:
    # A real failure of a real run on the CPU: the request's inputs (ONNX Runtime's own message).
    sess = ort.InferenceSession(
        demo_models.serialize(demo_models.multi_io()), providers=["CPUExecutionProvider"]
    )
    wrong = {"a": np.ones((1, 4), np.float32), "b": np.ones((1, 4), np.float32)}
    with pytest.raises(InvalidArgument) as raised:
        sess.run(["sum"], wrong)
    assert not is_device_fault(raised.value)
    assert isinstance(run_error(raised.value, "model m version 1"), InvalidInput)
    # A kernel's own check, and a message that names CUDA in another kind of exception.
    reshape = Fail(STATUS_PREFIX + NODE + "The input tensor cannot be reshaped to the requested shape.")
    assert not is_device_fault(reshape)
    assert not is_device_fault(ValueError(cuda_call()))
    assert not is_device_fault(RuntimeException(THROWN_PREFIX + "CUDA Provider not available"))


def test_a_bound_runs_device_failure_is_one_without_running_again() -> None:
    sess = ort.InferenceSession(
        demo_models.serialize(demo_models.multi_io()), providers=["CPUExecutionProvider"]
    )
    # Feeds that session.run would refuse as the request's fault: were the run tried again to
    # find the error's type, the answer would be INVALID_ARGUMENT, not the device's failure.
    wrong = {"a": np.ones((1, 4), np.float32), "b": np.ones((1, 4), np.float32)}
    bound_error = RuntimeError(
        UNTYPED_PREFIX + NODE + cuda_call("CUBLAS", 13, "CUBLAS_STATUS_EXECUTION_FAILED")
    )
    typed = typed_failure(bound_error, sess, wrong, ["sum"], None)
    assert isinstance(typed, RuntimeException) and is_device_fault(typed)
    assert isinstance(run_error(typed, "model m version 1"), DeviceFault)
    # And the real untyped error of a bound run (not the device's) is typed by running again.
    with pytest.raises(InvalidArgument):
        raise typed_failure(
            RuntimeError(UNTYPED_PREFIX + "Unexpected input data type"), sess, wrong, ["sum"], None
        )


@pytest.fixture
async def executor() -> AsyncIterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=2)
    yield pool
    pool.shutdown(wait=True)


async def test_a_device_fault_rests_the_instance_a_bounded_time_and_is_counted(
    executor: ThreadPoolExecutor,
) -> None:
    clock = HandClock()
    broken = FaultyRunner(Fail(STATUS_PREFIX + NODE + cuda_call()))
    healthy = FakeRunner()
    instances = Instances([broken, healthy], ["cuda:0", "cuda:1"], clock=clock, backoff_s=10.0)
    metrics = ServiceMetrics()
    metrics.instances.add("m", "1", instances)

    def sample(name: str, instance: str, device: str) -> float | None:
        return metric(metrics.registry, name, model="m", version="1", instance=instance, device=device)

    assert sample("modelyard_instance_device_faults_total", "0", "cuda:0") == 0
    x = {"x": np.ones((1, 3), np.float32)}
    with pytest.raises(DeviceFault, match="GPU=0"):
        await instances.run(x, ("y",), executor, "model m version 1")
    assert sample("modelyard_instance_device_faults_total", "0", "cuda:0") == 1
    assert sample("modelyard_instance_healthy", "0", "cuda:0") == 0
    # While it rests the other serves, even with runs pending on neither.
    for _ in range(3):
        await instances.run(x, ("y",), executor, "model m version 1")
    assert len(healthy.runs) == 3 and len(broken.runs) == 1
    # The rest is bounded: after it, the instance takes runs again (and fails again here).
    clock.now += 10.0
    assert sample("modelyard_instance_healthy", "0", "cuda:0") == 1
    with pytest.raises(DeviceFault):
        await instances.run(x, ("y",), executor, "model m version 1")
    assert sample("modelyard_instance_device_faults_total", "0", "cuda:0") == 2
    assert sample("modelyard_instance_device_faults_total", "1", "cuda:1") == 0
    # A failure of the model, not the device, rests nothing and counts nothing.
    plain = Instances(
        [FaultyRunner(Fail(STATUS_PREFIX + NODE + "Out of range value in index tensor")), FakeRunner()]
    )
    with pytest.raises(ModelRunError):
        await plain.run(x, ("y",), executor, "model m version 1")
    assert all(plain.healthy(i) and not i.faults for i in plain.all)
