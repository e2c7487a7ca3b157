"""The transport-agnostic request path: resolve a version, check the inputs, run, return outputs.

Both gRPC APIs (ours and KServe V2) convert their messages and call this; nothing here knows
about protobuf or gRPC.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

from service.errors import InvalidInput, ModelRunError
from service.runtime.manager import ModelManager
from service.runtime.served import ServedVersion


@dataclass(frozen=True)
class InferResult:
    model: str
    version: int
    outputs: dict[str, np.ndarray]
    row_offset: int = 0  # for chunks of a streamed batch
    last: bool = True  # False on every chunk of a streamed batch but the final one


class DataPlane:
    def __init__(self, manager: ModelManager, executor: Executor) -> None:
        self.manager = manager
        self._executor = executor

    async def infer(
        self,
        model: str,
        version: str,
        inputs: Mapping[str, np.ndarray],
        output_names: Sequence[str] = (),
    ) -> InferResult:
        admitted = time.perf_counter_ns()
        with self.manager.lease(model, version) as served:
            served.runner.signature.check_inputs(inputs)
            names = served.runner.signature.select_outputs(output_names)
            outputs = await self._run(served, inputs, names, admitted)
            return InferResult(model, served.version, outputs)

    async def infer_chunks(
        self,
        model: str,
        version: str,
        inputs: Mapping[str, np.ndarray],
        output_names: Sequence[str] = (),
        chunk_size: int = 0,
    ) -> AsyncGenerator[InferResult]:
        """Run a batch in chunks of rows, yielding each chunk's outputs as soon as it is computed.
        The whole stream holds one version: a swap mid-stream does not change it."""
        with self.manager.lease(model, version) as served:
            signature = served.runner.signature
            signature.check_inputs(inputs)
            names = signature.select_outputs(output_names)
            batch = next(iter(inputs.values())).shape[0] if signature.max_batch_size and inputs else 0
            if not batch:
                outputs = await self._run(served, inputs, names, time.perf_counter_ns())
                yield InferResult(model, served.version, outputs)
                return
            step = min(chunk_size or signature.max_batch_size, signature.max_batch_size)
            for offset in range(0, batch, step):
                chunk = {name: array[offset : offset + step] for name, array in inputs.items()}
                outputs = await self._run(served, chunk, names, time.perf_counter_ns())
                yield InferResult(model, served.version, outputs, offset, last=offset + step >= batch)

    async def _run(
        self, served: ServedVersion, inputs: Mapping[str, np.ndarray], names: Sequence[str], admitted_ns: int
    ) -> dict[str, np.ndarray]:
        runner = served.runner
        start = time.perf_counter_ns()
        ok = False
        try:
            if runner.runs_inline:
                arrays = runner.run(inputs, names)
            else:
                arrays = await asyncio.get_running_loop().run_in_executor(
                    self._executor, runner.run, inputs, names
                )
            ok = True
        except InvalidArgument as exc:
            # Shapes the schema allows (-1) but the graph's operators reject.
            raise InvalidInput(f"the model rejected the inputs: {_first_line(exc)}") from None
        except Exception as exc:
            raise ModelRunError(
                f"model {served.model} version {served.version} failed: {_first_line(exc)}"
            ) from None
        finally:
            end = time.perf_counter_ns()
            rows = next(iter(inputs.values())).shape[0] if served.config.max_batch_size and inputs else 1
            served.stats.record(
                ok, end - admitted_ns, rows, queue_ns=start - admitted_ns, compute_ns=end - start
            )
        return dict(zip(names, arrays, strict=True))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:500]
