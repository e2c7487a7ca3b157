"""WatchModels for all workers: the supervisor follows every admitted worker's WatchModels stream
and publishes a version's state when its merged state (the least ready of any worker, as in
merge.py) changes, so that a watcher connected to any worker sees the same events, and READY
only once every worker serves the version."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from modelyard.inference.v1 import model_service_pb2 as pb
from modelyard.inference.v1 import model_service_pb2_grpc as pb_grpc
from modelyard.service.workers.merge import least_ready

QUEUE_SIZE = 1024
Key = tuple[str, str]  # model, version
Call = grpc.aio.UnaryStreamCall[pb.WatchModelsRequest, pb.WatchModelsResponse]


class MergedWatch:
    def __init__(self) -> None:
        self._workers: dict[int, dict[Key, pb.WatchModelsResponse]] = {}
        self._merged: dict[Key, pb.WatchModelsResponse] = {}
        self._subscribers: set[asyncio.Queue[pb.WatchModelsResponse | None]] = set()

    async def join(self, index: int, channel: grpc.aio.Channel) -> asyncio.Task[None]:
        """Take in a worker's current state, then follow its changes (the returned task). Called
        before the worker is admitted, so that its joining changes nothing that was true."""
        stub = pb_grpc.ModelServiceStub(channel)
        stream = stub.WatchModels(pb.WatchModelsRequest(send_initial_state=True))
        # The initial state is one event per version: as many as the worker lists.
        listed = await stub.ListModels(pb.ListModelsRequest())
        table: dict[Key, pb.WatchModelsResponse] = {}
        for _ in range(sum(len(m.versions) for m in listed.models)):
            event = await stream.read()
            if not isinstance(event, pb.WatchModelsResponse):  # EOF: the worker went away
                break
            table[(event.model_name, event.version)] = event
        self._workers[index] = table
        for key in table:
            self._publish(key)
        return asyncio.get_running_loop().create_task(self._follow(index, stream))

    async def _follow(self, index: int, stream: Call) -> None:
        try:
            while isinstance(event := await stream.read(), pb.WatchModelsResponse):
                key = (event.model_name, event.version)
                self._workers.setdefault(index, {})[key] = event
                self._publish(key)
        except grpc.aio.AioRpcError:
            pass  # the worker went away
        finally:
            self.leave(index)

    def leave(self, index: int) -> None:
        if self._workers.pop(index, None) is not None:
            for key in list(self._merged):
                self._publish(key)

    def _publish(self, key: Key) -> None:
        events = [table[key] for table in self._workers.values() if key in table]
        if not events:
            return
        merged = pb.WatchModelsResponse()
        merged.CopyFrom(least_ready(events, missing=len(events) < len(self._workers)))
        merged.time.CopyFrom(max((e.time for e in events), key=lambda t: (t.seconds, t.nanos)))
        previous = self._merged.get(key)
        if previous is not None and (previous.state, previous.reason) == (merged.state, merged.reason):
            return
        self._merged[key] = merged
        for queue in list(self._subscribers):
            try:
                queue.put_nowait(merged)
            except asyncio.QueueFull:  # too slow a reader: it ends and must watch again
                self._subscribers.discard(queue)
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
                queue.put_nowait(None)

    async def stream(
        self, request: pb.WatchModelsRequest, announce: Callable[[int], Awaitable[None]]
    ) -> AsyncIterator[pb.WatchModelsResponse]:
        """The merged events; with send_initial_state, `announce` is told how many events the
        initial state is before they are yielded (x-initial-state-count, as one service sends)."""
        wanted = set(request.names)
        queue: asyncio.Queue[pb.WatchModelsResponse | None] = asyncio.Queue(QUEUE_SIZE)
        self._subscribers.add(queue)  # before the snapshot: no change is missed
        try:
            if request.send_initial_state:
                snapshot = [e for e in self._merged.values() if not wanted or e.model_name in wanted]
                await announce(len(snapshot))
                for current in snapshot:
                    yield current
            while True:
                event = await queue.get()
                if event is None:
                    raise OverflowError("the watch fell behind; watch again")
                if not wanted or event.model_name in wanted:
                    yield event
        finally:
            self._subscribers.discard(queue)
