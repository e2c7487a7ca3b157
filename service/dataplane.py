"""The transport-agnostic request path: resolve a version, check the inputs, run, return outputs.

Every API (ours, KServe V2, the flat one, Generate, an ensemble's steps) converts its messages and
calls this; nothing here knows about protobuf or gRPC. A request resolves its version once and
holds it to the end, on every path, unary or streamed:

    with dataplane.open(model, version, dye) as call:
        inputs = await call.take_inputs(inputs, outputs, request, reader)
        result = await call.infer(inputs, output_names, call.levelled(scheduling))
    answers = await call.answer(result.outputs, classify, in_shm, regions)  # where asked

so that the version whose limits checked the tensors, whose config sets the priority levels and
labels, and the one that runs are the same. The `Call` is the request's lease (runtime/served.py's
Lease): released once, when the block ends, whether the request answered, failed or was
cancelled. Where a request's run goes (`DataPlane.start_run`, the one place that decides): a
shadow's to spare capacity only; a version with a batcher (dynamic batching) through its queue
(priorities, deadlines); a cheap model's inline, on the event loop; any other to the executor.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

import numpy as np

from modelyard.common.headers import DYE_SHADOW
from modelyard.common.names import echo
from modelyard.service import answers, tracing
from modelyard.service.batching.layer import BatchingLayer, VersionBatcher
from modelyard.service.decoupled.runner import DecoupledRunner
from modelyard.service.errors import ServiceError, ShadowDropped, Unsupported
from modelyard.service.generation.model import DecoderModel
from modelyard.service.intake import (
    INLINE_DECODE_BYTES,
    Bounds,
    TensorHeader,
    bounds_for,
    check_headers,
    decode_fixed,
    offload,
    refuse_extra_tensors,
)
from modelyard.service.runtime.manager import ModelManager
from modelyard.service.runtime.runs import RunTiming
from modelyard.service.runtime.served import Lease, ServedVersion
from modelyard.service.scheduling.queue import DEFAULT_SCHEDULING, Scheduling
from modelyard.service.sequences.batcher import SequenceBatcher
from modelyard.service.sequences.step import Step
from modelyard.service.shm.registry import Regions
from modelyard.tensors import TensorError, name_of

Inputs = dict[str, np.ndarray]
Outputs = dict[str, np.ndarray]
S = TypeVar("S")


def _not_plain(source: object) -> None:
    return None


@dataclass(frozen=True, slots=True)
class TensorReader(Generic[S]):
    """How one API reads its request's tensors (`source`: as its servicer holds them) for
    Call.take_inputs, made once per API: `plain`, a plain request's headers and raw bytes (None
    for any other); `headers`, any request's headers, read without decoding; `decode`, its
    arrays. Plain functions of the source, so that a request makes no reader of its own."""

    headers: Callable[[S], Sequence[TensorHeader]]
    decode: Callable[[S], Inputs]
    plain: Callable[[S], tuple[Sequence[TensorHeader], Sequence[bytes]] | None] = _not_plain


_result = tuple.__new__


class InferResult(NamedTuple):  # a tuple: made for every request (a frozen dataclass costs more)
    model: str
    version: int
    outputs: dict[str, np.ndarray]
    row_offset: int = 0  # for chunks of a streamed batch
    last: bool = True  # False on every chunk of a streamed batch but the final one


def _checked(
    served: ServedVersion,
    inputs: Mapping[str, np.ndarray],
    output_names: Sequence[str],
    admitted_ns: int,
    fitted: bool = False,
) -> tuple[str, ...]:
    """The outputs to compute, once the inputs fit the version; a request they do not fit counts
    as a failed inference of that version (as Triton's statistics count it). `fitted`: the inputs
    were decoded from headers that fit (Call.take_inputs' plain request), so that only what their headers do
    not show is left to check: that every input is given, and one batch size across inputs."""
    signature = served.runner.signature
    try:
        if (
            not fitted
            or len(inputs) != len(signature.inputs)
            or (signature.max_batch_size and len(inputs) > 1)
        ):
            signature.check_inputs(inputs)  # every check, and its precise answer
        return signature.select_outputs(output_names)
    except ServiceError:
        served.stats.record_request(False, time.perf_counter_ns() - admitted_ns)
        raise


class DataPlane:
    def __init__(
        self, manager: ModelManager, executor: Executor, batching: BatchingLayer | None = None
    ) -> None:
        self.manager = manager
        self._table = manager.table  # the request path resolves and leases here
        self.executor = executor  # runs and large decodes: off the event loop
        self._shadow_calls = manager.metrics.shadow_calls
        # The batched versions' batchers (the batching layer's, read-only; none without it).
        self._batchers: Mapping[ServedVersion, VersionBatcher] = (
            batching.batchers if batching is not None else {}
        )
        # Each version's bounds (`bounds`), until it retires: read on every request, so a call
        # reads this first and asks `bounds` only on a miss (one call fewer per request).
        self._bounds: dict[ServedVersion, Bounds] = {}
        self.known_bounds: Mapping[ServedVersion, Bounds] = self._bounds

    def open(self, model: str, version: str, dye: str = "") -> Call:
        """`with dataplane.open(model, version) as call:` resolves the version now (an unknown
        model or version raises here, leasing nothing) and leases it until the block ends. The
        call's metrics and span name the version from here on, should it fail. `dye`: the call's
        x-model-dye (a proxy's call: its run is timed for its answer); a shadow call that finds
        no spare capacity is refused here (ShadowDropped), before its tensors are decoded."""
        served = self._table.resolve(model, version)
        tracing.resolved(served.version_name)
        return Call(self, served, dye)

    def hold(self, served: ServedVersion, dye: str = "") -> Call:
        """`open` for a version already known: a live sequence's (which its own lease keeps even
        once a reload took it out of the served table), or a stream's that resolved it already."""
        tracing.resolved(served.version_name)
        return Call(self, served, dye)

    async def infer(
        self,
        model: str,
        version: str,
        inputs: Mapping[str, np.ndarray],
        output_names: Sequence[str] = (),
        scheduling: Scheduling = DEFAULT_SCHEDULING,
    ) -> InferResult:
        """One run of already decoded inputs (open, infer, close)."""
        with self.open(model, version) as call:
            return await call.infer(inputs, output_names, scheduling)

    def bounds(self, served: ServedVersion) -> Bounds:
        """What a request's tensors must fit to run on `served` (its signature, its config's
        limits, a decoder's context length): worked out on its first request, kept until it
        retires."""
        bounds = self._bounds.get(served)
        if bounds is None:
            kind = served.runner.kind
            decoder = kind if isinstance(kind, DecoderModel) else None
            bounds = self._bounds[served] = bounds_for(served.runner.signature, served.config.limits, decoder)
            served.on_retire(self._forget_bounds)
        return bounds

    async def _forget_bounds(self, served: ServedVersion) -> None:
        self._bounds.pop(served, None)

    def batcher(self, served: ServedVersion) -> VersionBatcher | None:
        """The worker that takes `served`'s requests (a dynamic, sequence or decoupled batcher:
        the batching layer's), or None: each request runs as it comes."""
        return self._batchers.get(served)

    def start_run(
        self,
        served: ServedVersion,
        inputs: Mapping[str, np.ndarray],
        names: Sequence[str],
        scheduling: Scheduling,
        admitted_ns: int,
        timing: RunTiming | None,
    ) -> Outputs | Awaitable[Outputs]:
        """Where a request's run goes, decided here and nowhere else. A shadow call (x-model-dye:
        shadow): only on spare capacity, on the shadows' own thread. A version with a batcher:
        its queue. A cheap model's (`instances.runs_inline`): inline, now, its outputs returned
        (the common case: no coroutine, no await). Any other: the executor, for one of its
        version's run slots. The awaited ones return the awaitable of their outputs. `timing`:
        the call whose answer reports its run's timing (a dyed call), else None."""
        if scheduling.shadow:
            return self._shadow(served, inputs, names, admitted_ns, timing)
        batcher = self._batchers.get(served)
        if batcher is not None:
            if tracing.enabled:
                return self._batched(batcher, inputs, names, scheduling, timing)
            return batcher.infer(inputs, names, scheduling, timing)  # its coroutine, unwrapped
        if served.instances.runs_inline:
            return self._run_inline(served, inputs, names, admitted_ns, timing)
        return self._run_in_executor(served, inputs, names, scheduling, admitted_ns, timing)

    def _run_inline(
        self,
        served: ServedVersion,
        inputs: Mapping[str, np.ndarray],
        names: Sequence[str],
        admitted_ns: int,
        timing: RunTiming | None,
    ) -> Outputs:
        """A run of its own, on the event loop (a plain function: no coroutine per call), counted
        in the version's statistics."""
        start = time.perf_counter_ns()
        ok = False
        try:
            if tracing.enabled:
                arrays = tracing.traced("run", served.instances.run_here, inputs, names, served.label)
            else:  # most calls: no span to open, and one call fewer
                arrays = served.instances.run_here(inputs, names, served.label)
            ok = True
        finally:
            end = served.stats.record_run(ok, inputs, served.config.max_batch_size, admitted_ns, start)
        if timing is not None:
            timing.queue_ns, timing.run_ns = start - admitted_ns, end - start
        return _by_name(names, arrays)

    async def _batched(
        self,
        batcher: VersionBatcher,
        inputs: Mapping[str, np.ndarray],
        names: Sequence[str],
        scheduling: Scheduling,
        timing: RunTiming | None,
    ) -> Outputs:
        """A batched request with a span to open: its wait and run in the batcher as one step."""
        with tracing.step("batch"):
            return await batcher.infer(inputs, names, scheduling, timing)

    async def _run_in_executor(
        self,
        served: ServedVersion,
        inputs: Mapping[str, np.ndarray],
        names: Sequence[str],
        scheduling: Scheduling,
        admitted_ns: int,
        timing: RunTiming | None,
    ) -> Outputs:
        """A run of its own on an executor thread, once one of its version's run slots is free
        (within the request's queue timeout and deadline), counted in the version's statistics."""
        if timing is not None:
            timing.admitted_ns = admitted_ns
        start = time.perf_counter_ns()
        ok = False
        try:
            with tracing.step("run"):
                arrays = await served.instances.run(
                    inputs, names, self.executor, served.label, timing, scheduling
                )
            ok = True
        finally:
            served.stats.record_run(ok, inputs, served.config.max_batch_size, admitted_ns, start)
        return _by_name(names, arrays)

    def shadow_refusal(self, served: ServedVersion) -> ShadowDropped | None:
        """Why a shadow call (x-model-dye: shadow) to `served` may not run now, counted as dropped;
        None when capacity is spare: an idle run thread, an idle run slot of its version (or of
        its batcher), the shadows' thread free, and no real call waiting for a run slot (its
        version's or any batcher's). A shadow never queues."""
        instances = served.instances
        why = instances.capacity.spare(len(instances.runs))
        if not why:
            batcher = self._batchers.get(served)
            if not (batcher.has_idle_slot if batcher is not None else instances.has_idle_slot):
                why = f"{served.label} has no idle run slot"
            elif any(b.queued for b in self._batchers.values()):
                why = "calls wait in a batcher's queue"
        if not why:
            return None
        self._shadow_calls.labels(served.model, "dropped").inc()
        return ShadowDropped(
            f"{served.label}: a shadow call runs only on spare capacity, and {why}; dropped, not queued"
        )

    async def _shadow(
        self,
        served: ServedVersion,
        inputs: Mapping[str, np.ndarray],
        names: Sequence[str],
        admitted_ns: int,
        timing: RunTiming | None,
    ) -> Outputs:
        """A shadow call: at the lowest priority, on the shadows' own idle-priority thread, only
        while capacity is spare (shadow_refusal, asked again: its decoding may have awaited)."""
        refused = self.shadow_refusal(served)
        if refused is not None:
            raise refused
        self._shadow_calls.labels(served.model, "run").inc()
        if timing is not None:
            timing.admitted_ns = admitted_ns
        start = time.perf_counter_ns()
        ok = False
        try:
            with tracing.step("run"):
                arrays = await served.instances.run_shadow(inputs, names, served.label, timing)
            ok = True
        finally:
            served.stats.record_run(ok, inputs, served.config.max_batch_size, admitted_ns, start)
        return _by_name(names, arrays)


async def _outputs(started: Outputs | Awaitable[Outputs]) -> Outputs:
    """A started run's outputs (start_run's answer), for the paths that await anyway."""
    return started if isinstance(started, dict) else await started


def _priority_levels(served: ServedVersion) -> int:
    """The priority levels a version's requests may ask: its dynamic batcher's, or a decoder's
    decode queue's; 0 for a version with neither (every request at its default)."""
    kind = served.runner.kind
    if isinstance(kind, DecoderModel):
        return kind.settings.admission.priority_levels
    batching = served.config.dynamic_batching
    return batching.admission.priority_levels if batching is not None else 0


def _by_name(names: Sequence[str], arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """A run's outputs by name (ONNX Runtime returns one array per name asked, in order)."""
    if len(names) == 1 == len(arrays):  # most models: a dict of one, without zip's machinery
        return {names[0]: arrays[0]}
    return dict(zip(names, arrays, strict=True))


class Call(Lease):
    """One request's lease on the version that serves it (DataPlane.open or hold), with what the
    request does on it: check and decode its tensors, run, stream. Released once, when its `with`
    block ends (Lease), whatever the end; held while the request decodes and while it waits in a
    batcher's queue, so that a retiring version answers what it has admitted before it goes.
    It reaches the data plane through its public methods only."""

    __slots__ = ("_fitted", "_plane", "admitted_ns", "dye", "queue_ns", "run_ns")

    def __init__(self, plane: DataPlane, served: ServedVersion, dye: str = "") -> None:
        # Lease.__init__, inline (a call is made per request): the lease is taken here.
        self.served = served
        self._held = True
        served.in_flight += 1
        self._plane = plane
        self._fitted: object = None  # the inputs take_inputs decoded from plain headers
        # The last run's own measurement (RunTiming): its wait from admission and its run, in
        # perf_counter ns; what a unary answer to a dyed call reports as x-queue-us and x-run-us.
        self.admitted_ns = self.queue_ns = self.run_ns = 0
        # The call's x-model-dye (a proxy's call): only a dyed call's run is timed for its answer.
        self.dye = dye
        if dye == DYE_SHADOW and (refused := plane.shadow_refusal(served)) is not None:
            # A shadow call runs on spare capacity only: refused before its tensors are decoded.
            self.release()
            raise refused

    def detached(self) -> Call:
        """A lease of its own on this call's version, for work that outlives this call's block
        (a decoupled request's responses, a decoder's text stream), with what this call knows of
        its inputs and its dye; its holder releases it."""
        other = Call(self._plane, self.served)
        other._fitted, other.dye = self._fitted, self.dye
        return other

    @property
    def is_decoupled(self) -> bool:
        """Whether the version answers a request with 0..N responses (`decoupled`)."""
        return isinstance(self._plane.batcher(self.served), DecoupledRunner)

    def _check(self, headers: Sequence[TensorHeader]) -> None:
        """Check a request's tensors (their headers) against the version's bounds."""
        started = time.perf_counter_ns()
        plane, served = self._plane, self.served
        try:
            check_headers(plane.known_bounds.get(served) or plane.bounds(served), headers)
        except (ServiceError, TensorError):
            # A request that does not fit counts as a failed inference of the version, as when
            # check_inputs refuses it (Triton's statistics count it so).
            served.stats.record_request(False, time.perf_counter_ns() - started)
            raise

    def check_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Check tensors made in the service (an ensemble step's inputs) against the version's
        bounds and limits, as a request's headers are checked before it decodes."""
        self._check(
            [
                TensorHeader(
                    name,
                    name_of(a.dtype),
                    a.shape,
                    sum(len(x) for x in a.reshape(-1)) if a.dtype == object else a.nbytes,
                    a.dtype == object,
                )
                for name, a in arrays.items()
            ]
        )

    async def take_inputs(self, inputs: int, outputs: int, source: S, reader: TensorReader[S]) -> Inputs:
        """A request's input tensors, checked against the version before a byte of them is
        decoded (service/intake.py), for every API alike. `inputs` and `outputs`: how many the
        request names (many more than the model has are refused before any work per tensor, so
        `reader` is used only after that). `source`: the request's tensors as the API holds them,
        which its `reader` reads: a plain request (`reader.plain`: fixed-size datatypes, raw
        contents) is decoded from its checked headers without copying, on the loop, and `infer`
        on these arrays checks only what the headers cannot show; any other's `reader.headers`
        are checked, then `reader.decode` runs: inline when small, in the executor when large, so
        that the event loop never waits on a request's decoding; `infer` checks the decoded
        arrays again."""
        served = self.served
        refuse_extra_tensors(served.model, served.runner.signature, inputs, outputs)
        fixed = reader.plain(source)
        if fixed is not None:
            self._check(fixed[0])
            arrays = decode_fixed(*fixed)
            self._fitted = arrays
            return arrays
        described = reader.headers(source)
        self._check(described)
        if offload(described):
            return await asyncio.get_running_loop().run_in_executor(
                self._plane.executor, reader.decode, source
            )
        return reader.decode(source)

    def levelled(self, scheduling: Scheduling) -> Scheduling:
        """`scheduling` at a priority the version has: as Triton's KServe rule, a priority level
        the version does not have (no dynamic batching, or past its levels) means its default.
        (Our own API refuses such a priority instead: the admission queue says why.)"""
        if scheduling.priority and scheduling.priority > _priority_levels(self.served):
            return scheduling._replace(priority=0)
        return scheduling

    def responses(
        self,
        inputs: Mapping[str, np.ndarray],
        output_names: Sequence[str],
        scheduling: Scheduling,
        to_shared_memory: bool = False,
    ) -> tuple[Call, AsyncGenerator[InferResult]] | None:
        """A decoupled version's responses to the request (service/decoupled/), each as it comes,
        on a lease of their own (`detached`: its holder releases it once they end); None for a
        version that is not decoupled (one response: `infer`). Their outputs ride in each
        response: one asked into shared memory is refused."""
        if not self.is_decoupled:
            return None
        if to_shared_memory:
            raise Unsupported(
                f"model {echo(self.served.model)} is decoupled: its outputs are not written to shared "
                "memory (each response carries its own)"
            )
        own = self.detached()
        results = own.decoupled(inputs, output_names, scheduling)
        assert results is not None
        return own, results

    def classified(self, outputs: Outputs, classify: Mapping[str, int], by_row: bool = True) -> Outputs:
        """`outputs` with those named in `classify` as Triton's classification strings (their k
        largest values, with the version's class labels): row by row where `by_row` and the
        version batches."""
        served = self.served
        batched = by_row and bool(served.config.max_batch_size)
        return answers.classified(outputs, classify, batched, served.labels)

    async def answer(
        self,
        outputs: Outputs,
        classify: Mapping[str, int],
        in_shm: Mapping[str, answers.ShmLocation],
        regions: Callable[[], Regions],
    ) -> Outputs:
        """A run's outputs as the request asked them beyond their names: classified (`classify`:
        k by output), and those named in `in_shm` written into the caller's shared memory
        regions (`regions()`), off the event loop when large. The outputs are returned (an
        API's answer still names those in shared memory, with an empty payload)."""
        if classify:
            outputs = self.classified(outputs, classify)
        if in_shm:
            shared = regions()
            if sum(size for _, _, size in in_shm.values()) > INLINE_DECODE_BYTES:
                # Large copies into shared memory (pwrite) go off the event loop (the loop's own
                # executor: the run threads are the models').
                await asyncio.get_running_loop().run_in_executor(
                    None, answers.write_to_regions, outputs, in_shm, shared
                )
            else:
                answers.write_to_regions(outputs, in_shm, shared)
        return outputs

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        output_names: Sequence[str] = (),
        scheduling: Scheduling = DEFAULT_SCHEDULING,
    ) -> InferResult:
        self.admitted_ns = admitted = time.perf_counter_ns()
        served = self.served
        signature = served.runner.signature
        if inputs is self._fitted and not output_names and len(inputs) == 1 == len(signature.inputs):
            # A plain request to a one-input model, for every output (most): its headers showed
            # all that _checked would check, so the check is skipped.
            names = signature.output_names
        else:
            names = _checked(served, inputs, output_names, admitted, inputs is self._fitted)
        # A dyed call (a proxy's) is timed: its answer reports its run's wait and run.
        started = self._plane.start_run(
            served, inputs, names, scheduling, admitted, self if self.dye else None
        )
        outputs = started if isinstance(started, dict) else await started
        # Made as the tuple it is: a NamedTuple's own __new__ is a Python function.
        return _result(InferResult, (served.model, served.version, outputs, 0, True))

    async def infer_chunks(
        self,
        inputs: Mapping[str, np.ndarray],
        output_names: Sequence[str] = (),
        chunk_size: int = 0,
        scheduling: Scheduling = DEFAULT_SCHEDULING,
    ) -> AsyncGenerator[InferResult]:
        """Run a batch in chunks of rows, yielding each chunk's outputs as soon as it is computed.
        The whole stream runs on the call's version: a swap mid-stream does not change it. With
        dynamic batching each chunk queues at the request's priority, with the request's deadline."""
        served, start = self.served, self._plane.start_run
        signature = served.runner.signature
        names = _checked(served, inputs, output_names, time.perf_counter_ns())
        batch = next(iter(inputs.values())).shape[0] if signature.max_batch_size and inputs else 0
        if not batch:
            outputs = await _outputs(start(served, inputs, names, scheduling, time.perf_counter_ns(), None))
            yield InferResult(served.model, served.version, outputs)
            return
        step = min(chunk_size or signature.max_batch_size, signature.max_batch_size)
        for offset in range(0, batch, step):
            chunk = {name: array[offset : offset + step] for name, array in inputs.items()}
            outputs = await _outputs(start(served, chunk, names, scheduling, time.perf_counter_ns(), None))
            yield InferResult(served.model, served.version, outputs, offset, last=offset + step >= batch)

    async def infer_step(
        self,
        inputs: Mapping[str, np.ndarray],
        output_names: Sequence[str],
        scheduling: Scheduling,
        step: Step,
    ) -> InferResult:
        """A request that names a sequence (KServe's sequence_id): one step of it, on a sequence
        model's batcher (service/sequences/); on any other model, an ordinary request (as Triton
        ignores the sequence parameters of a model without a sequence batcher)."""
        served = self.served
        batcher = self._plane.batcher(served)
        if not isinstance(batcher, SequenceBatcher):
            return await self.infer(inputs, output_names, scheduling)
        self.admitted_ns = admitted = time.perf_counter_ns()
        names = _checked(served, inputs, output_names, admitted, inputs is self._fitted)
        outputs = await batcher.step(inputs, names, step, scheduling, self if self.dye else None)
        return _result(InferResult, (served.model, served.version, outputs, 0, True))

    def decoupled(
        self,
        inputs: Mapping[str, np.ndarray],
        output_names: Sequence[str] = (),
        scheduling: Scheduling = DEFAULT_SCHEDULING,
    ) -> AsyncGenerator[InferResult] | None:
        """A decoupled version's responses to the request (service/decoupled/), each as it comes;
        None for a version that is not decoupled (one response: `infer`). The responses run on
        this call's version: iterate them while this call is held (or a `hold` of its version)."""
        runner = self._plane.batcher(self.served)
        if not isinstance(runner, DecoupledRunner):
            return None
        return self._responses(runner, inputs, output_names, scheduling)

    async def _responses(
        self,
        runner: DecoupledRunner,
        inputs: Mapping[str, np.ndarray],
        output_names: Sequence[str],
        scheduling: Scheduling,
    ) -> AsyncGenerator[InferResult]:
        served = self.served
        names = _checked(served, inputs, output_names, time.perf_counter_ns(), inputs is self._fitted)
        async for outputs in runner.responses(inputs, names, scheduling):
            yield InferResult(served.model, served.version, outputs, 0, False)
