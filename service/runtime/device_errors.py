"""How ONNX Runtime says that a device failed, when it has no exception type for it.

Its CUDA provider checks every CUDA library call (cuda_call.h: CUDA_CALL, CUBLAS_CALL, CUSPARSE_CALL,
CURAND_CALL, CUDNN_CALL, CUDNN_FE_CALL, CUFFT_CALL, NCCL_CALL) and, on an error, throws or returns
"<LIB> failure <code>: <text> ; GPU=<id> ; hostname=<host> ; file=<f> ; line=<n> ; expr=<call>; "
(cuda_call.cc; the format string and the library names, cuDNN's frontend "CUDNN_FE" among them,
are in 1.31.1's libonnxruntime_providers_cuda.so), or, in older builds, a status
"<LIB> error executing <call>" (cuda_common.h's *_RETURN_IF_ERROR); they reach Python as
Fail or RuntimeException, or, from a bound run, as a plain RuntimeError (iobinding.py). CUDA's own
error names (cudaErrorIllegalAddress, ...) say the same.
"""

from __future__ import annotations

import re

DEVICE_MESSAGE = re.compile(
    r"\b(CUDA|CUBLAS|CUSPARSE|CURAND|CUDNN|CUDNN_FE|CUFFT|NCCL) (failure|error)\b|\bcudaError", re.IGNORECASE
)


# A device that ran out of memory has not failed: cudaMalloc's cudaErrorMemoryAllocation ("CUDA
# failure 2: out of memory") and the libraries' *_STATUS_ALLOC_FAILED come from the run's own size,
# as the arena's refusals do, so they are the run's memory bound (session.run_error), not a fault
# that rests the instance.
OUT_OF_MEMORY = re.compile(r"\bout of memory\b|cudaErrorMemoryAllocation|_STATUS_ALLOC_FAILED", re.IGNORECASE)


def names_a_device_failure(message: str) -> bool:
    return DEVICE_MESSAGE.search(message) is not None and not names_out_of_device_memory(message)


def names_out_of_device_memory(message: str) -> bool:
    return OUT_OF_MEMORY.search(message) is not None
