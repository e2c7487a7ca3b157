"""The runs of a decoupled version (Triton's model_transaction_policy {decoupled: true}): a request
gets any number of outputs, each a response of its ModelStreamInfer stream; unary ModelInfer is
refused, as Triton refuses it.

Without `decoupled.repeat`, a request is one run and one response. With it, the version behaves as
Triton's `repeat` backend (repeat_backend/src/repeat.cc) over an ONNX graph: the inputs it lists
are split along their first dimension, and the graph runs once per element, fed element i of each
(shape [1, ...]), the other inputs whole, and, where `index_input` is given, i (UINT32 [1]); each
run's outputs are response i. Before response i it waits element i of `delay_input` in ms, and the
request holds one of the version's instances for `hold_input` ms (the repeat model's WAIT) or until
its last response, whichever comes first, so that with one instance a second request starts once
the first lets go, their responses interleaving as Triton's do. Each wait is bounded by
`max_delay_ms` (a longer one is refused: INVALID_ARGUMENT), the elements by the model's limits.
A request with no elements gets no response (only the final flag, when the client asks for it).

The graph computes every output: the repeat example's OUT is an Identity of IN, its IDX an
Identity of the index input; the service only splits, feeds, waits and sends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import Executor

import numpy as np

from modelyard.service.errors import InvalidInput, ModelUnavailable, Unsupported
from modelyard.service.repository.model_config import RepeatConfig
from modelyard.service.runtime.runs import RunTiming
from modelyard.service.runtime.served import ServedVersion
from modelyard.service.scheduling.queue import DEFAULT_SCHEDULING, Scheduling

Outputs = dict[str, np.ndarray]

UNARY_REFUSED = "ModelInfer RPC doesn't support models with decoupled transaction policy"


class DecoupledRunner:
    def __init__(self, served: ServedVersion, executor: Executor) -> None:
        self.served = served
        self.name = served.label
        self._executor = executor
        decoupled = served.config.decoupled
        self._repeat: RepeatConfig | None = decoupled.repeat if decoupled is not None else None
        # The instances a request may hold (the repeat model's WAIT), one request each.
        self._holds = asyncio.Semaphore(len(served.instances.all))
        self._producing = 0
        self._closed = False

    # -- what the data plane asks of a batcher ------------------------------------------------

    @property
    def queued(self) -> int:
        return 0

    @property
    def has_idle_slot(self) -> bool:
        return self.served.instances.has_idle_slot

    async def infer(
        self,
        feeds: Mapping[str, np.ndarray],
        names: Sequence[str],
        scheduling: Scheduling = DEFAULT_SCHEDULING,
        timing: RunTiming | None = None,
    ) -> Outputs:
        """A unary call: refused (its responses need a stream)."""
        raise Unsupported(f"{UNARY_REFUSED} (model '{self.served.model}': call ModelStreamInfer)")

    async def close(self) -> None:
        self._closed = True

    # -- responses ----------------------------------------------------------------------------

    async def responses(
        self,
        feeds: Mapping[str, np.ndarray],
        names: Sequence[str],
        scheduling: Scheduling = DEFAULT_SCHEDULING,
    ) -> AsyncIterator[Outputs]:
        """The request's responses, each as soon as it is computed (checked inputs)."""
        if self._closed:
            raise ModelUnavailable(f"{self.name} is no longer served")
        names = tuple(names) or self.served.runner.signature.output_names
        repeat = self._repeat
        started = time.perf_counter_ns()
        ok = False
        stats = self.served.stats
        stats.record_queue(0)
        try:
            if repeat is None:
                yield await self._run(dict(feeds), names, scheduling)
            else:
                async for outputs in self._repeated(repeat, feeds, names, scheduling):
                    yield outputs
            ok = True
        finally:
            stats.record_request(ok, time.perf_counter_ns() - started)

    async def _repeated(
        self,
        repeat: RepeatConfig,
        feeds: Mapping[str, np.ndarray],
        names: tuple[str, ...],
        scheduling: Scheduling,
    ) -> AsyncIterator[Outputs]:
        split = [feeds[name] for name in repeat.inputs]
        count = split[0].shape[0]
        for name, array in zip(repeat.inputs[1:], split[1:], strict=True):
            if array.shape != split[0].shape:
                raise InvalidInput(
                    f"expected {repeat.inputs[0]} and {name} shape to match, got {list(split[0].shape)} and "
                    f"{list(array.shape)}"
                )
        delays = self._waits(feeds, repeat.delay_input, repeat.max_delay_ms) if repeat.delay_input else None
        hold_s = (
            self._waits(feeds, repeat.hold_input, repeat.max_delay_ms, 1)[0] if repeat.hold_input else 0.0
        )
        loop = asyncio.get_running_loop()
        await self._holds.acquire()
        held = True

        def let_go() -> None:
            nonlocal held
            if held:
                held = False
                self._holds.release()

        timer = loop.call_later(hold_s, let_go)
        try:
            for index in range(count):
                if delays is not None and delays[index]:
                    await asyncio.sleep(delays[index])
                if self._closed:
                    raise ModelUnavailable(f"{self.name} stopped serving before the request's last response")
                one = {
                    name: (array[index : index + 1] if name in repeat.inputs else array)
                    for name, array in feeds.items()
                }
                if repeat.index_input:
                    one[repeat.index_input] = np.array([index], dtype=np.uint32)
                yield await self._run(one, names, scheduling)
        finally:
            timer.cancel()
            let_go()

    def _waits(self, feeds: Mapping[str, np.ndarray], name: str, max_ms: int, least: int = 0) -> list[float]:
        values = [int(v) for v in np.asarray(feeds[name]).reshape(-1)]
        if len(values) < least:
            raise InvalidInput(f"input {name!r} holds no value")
        for value in values:
            if value > max_ms:
                raise InvalidInput(
                    f"input {name!r}: a wait of {value} ms; {self.name} allows at most {max_ms} "
                    "(decoupled.repeat.max_delay_ms)"
                )
        return [value / 1000 for value in values]

    async def _run(
        self, feeds: dict[str, np.ndarray], names: tuple[str, ...], scheduling: Scheduling
    ) -> Outputs:
        served = self.served
        start = time.perf_counter_ns()
        arrays = await served.instances.run(feeds, names, self._executor, served.label, None, scheduling)
        elapsed = time.perf_counter_ns() - start
        served.stats.record_execution(1, elapsed)
        return dict(zip(names, arrays, strict=True))
