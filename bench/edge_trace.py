"""Where the edge's time to first token goes, step by step, in the gateway and the sidecar, in one run:

    .venv/bin/python -m bench.edge_trace [--trees base=DIR,now=DIR] [--flags NAME='FLAGS'] [--requests 40]
        [--dump]

The stack runs as for bench.edge (its service is the upstream); beside it, per --trees / --flags
entry (default: this tree), a sidecar from that tree on the service and a gateway from it on that
sidecar, each run by this file with timestamps at each step of the first token's path.
time.perf_counter is CLOCK_MONOTONIC on Linux, one clock for every process, so the client's send
and first token line up with both processes' steps. The pairs take turns request by request, back
and forth (with a direct call to the stack's sidecar in each turn, for reference); the table gives
each step's median and fastest per pair, and each process's CPU per request. `--dump` prints each
request's steps in the order they happened.

The first token's path (the table's rows, in order): recv (the request's bytes reach uvicorn) ->
handler (the SSE endpoint entered: uvicorn's task, Starlette's middleware and routing) -> body
(read) -> parsed (parse_generate) -> sc.entered (the sidecar's handler: the gateway's call made
and sent, the sidecar's server reading it) -> sc.planned (the call's scope and the planner's first
attempt) -> sc.called (the upstream call made) -> sc.up_initmd (the service's initial metadata,
sent once the request is accepted, while its prompt runs) -> sc.up_msg1 (its first message: the
rest of the prefill, the service's write, and the one-byte window's round trip; the service's
own time is sc.called -> sc.up_msg1) -> sc.write_call (written to the gateway) -> msg1 (the
gateway's producer has it: the gateway's one-byte window) -> resumed (the first event buffered,
the endpoint woken) -> start_send (the response headers) -> body_call (the first event) -> the
client's first token. Beside the path (not waited on by it): send (the gateway's call's own task
starting to send the request), producer (the gateway's producer task running), sc.initmd_sent
(the sidecar's headers sent to the gateway; from sc.up_initmd), initmd (the gateway has them),
sc.written (the sidecar's write completed), body_send (the gateway's).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, cast

STEPS = (
    "recv",
    "handler",
    "body",
    "parsed",
    "send",
    "producer",
    "initmd",
    "msg1",
    "resumed",
    "start_send",
    "body_call",
    "body_send",
)
PROMPT = "def __init__(self"


SIDECAR_STEPS = (
    "sc.entered",
    "sc.planned",
    "sc.called",
    "sc.up_initmd",
    "sc.initmd_sent",
    "sc.up_msg1",
    "sc.write_call",
    "sc.written",
)
# The first token's path through both processes (one clock), and the steps beside it: (step, the
# path's step it is measured from).
CHAIN = (
    "recv",
    "handler",
    "body",
    "parsed",
    "sc.entered",
    "sc.planned",
    "sc.called",
    "sc.up_initmd",
    "sc.up_msg1",
    "sc.write_call",
    "msg1",
    "resumed",
    "start_send",
    "body_call",
)
BESIDE = (
    ("send", "parsed"),
    ("producer", "parsed"),
    ("sc.initmd_sent", "sc.up_initmd"),
    ("initmd", "sc.up_initmd"),
    ("sc.written", "sc.write_call"),
    ("body_send", "body_call"),
)


def serve_sidecar(argv: Sequence[str]) -> int:
    """The sidecar (`python -m modelyard.sidecar ARGS`) with its stream path's timestamps, one line
    per Generate call appended to $EDGE_TRACE: entered (the handler), planned (the planner's first
    attempt), called (the upstream call made), up_initmd (the upstream's initial metadata),
    initmd_sent (the caller's headers sent), up_msg1 (the upstream's first message), write_call and
    written (that message written to the caller)."""
    from modelyard.sidecar import forward, proxy
    from modelyard.sidecar.cli import main

    out = Path(os.environ["EDGE_TRACE"]).open("a", buffering=1)  # noqa: SIM115  # the process's life
    now: dict[str, float] = {}
    clock = time.perf_counter

    class TracedUpstreamCall:
        def __init__(self, call: Any) -> None:
            self._call = call

        def __getattr__(self, name: str) -> Any:
            return getattr(self._call, name)

        async def initial_metadata(self) -> Any:
            metadata = await self._call.initial_metadata()
            now.setdefault("sc.up_initmd", clock())
            return metadata

        async def read(self) -> Any:
            message = await self._call.read()
            now.setdefault("sc.up_msg1", clock())
            return message

        def __aiter__(self) -> AsyncIterator[Any]:
            return self._messages()

        async def _messages(self) -> AsyncIterator[Any]:
            async for message in self._call:
                now.setdefault("sc.up_msg1", clock())
                yield message

    class TracedContext:
        def __init__(self, context: Any) -> None:
            self._context = context

        def __getattr__(self, name: str) -> Any:
            return getattr(self._context, name)

        async def send_initial_metadata(self, metadata: Any) -> None:
            await self._context.send_initial_metadata(metadata)
            now.setdefault("sc.initmd_sent", clock())

        async def write(self, message: Any) -> None:
            first = "sc.write_call" not in now
            if first:
                now["sc.write_call"] = clock()
            await self._context.write(message)
            if first:
                now["sc.written"] = clock()
                if all(step in now for step in SIDECAR_STEPS):
                    out.write(repr(dict(now)) + "\n")

    send = forward.send

    async def traced_send(messages: Any, context: Any) -> None:
        now.clear()
        now["sc.entered"] = clock()
        await send(messages, cast(Any, TracedContext(context)))

    relay = forward.relay

    def traced_relay(call: Any, context: Any, added: Any) -> Any:
        return relay(call, cast(Any, TracedContext(context)), added)

    start = forward.start

    def traced_start(*args: Any) -> Any:
        call = TracedUpstreamCall(start(*args))
        now["sc.called"] = clock()
        return call

    first_attempt = proxy.Proxy._first_attempt

    def traced_first_attempt(self: Any, *args: Any) -> Any:
        plan = first_attempt(self, *args)
        now["sc.planned"] = clock()
        return plan

    forward.send = traced_send
    forward.relay = traced_relay
    forward.start = traced_start  # type: ignore[assignment]
    proxy.Proxy._first_attempt = traced_first_attempt  # type: ignore[method-assign,assignment]
    return main(argv)


def serve(argv: Sequence[str]) -> int:
    """The gateway (`python -m modelyard.gateway ARGS`) with the steps' timestamps, one line per
    request (a dict literal) appended to the file named by $EDGE_TRACE."""
    from uvicorn.protocols.http import httptools_impl as uvicorn_http

    from modelyard.gateway import http, streams
    from modelyard.gateway.cli import main
    from modelyard.gateway.sse import serving

    out = Path(os.environ["EDGE_TRACE"]).open("a", buffering=1)  # noqa: SIM115  # the process's life
    now: dict[str, float] = {}
    clock = time.perf_counter

    data_received = uvicorn_http.HttpToolsProtocol.data_received

    def traced_data_received(self: Any, data: bytes) -> None:
        if data[:5] in (b"POST ", b"GET /"):
            now.clear()
            now["recv"] = clock()
        data_received(self, data)

    post = serving.GenerateEndpoints.post

    async def traced_post(self: Any, request: Any) -> Any:
        now["handler"] = clock()
        return await post(self, request)

    read_json = http.read_json

    async def traced_read_json(request: Any, limit: int) -> Any:
        body = await read_json(request, limit)
        now["body"] = clock()
        return body

    open_stream = serving.GenerateEndpoints.open_stream

    async def traced_open_stream(self: Any, generate: Any, *rest: Any) -> Any:  # metadata (, caller)
        now["parsed"] = clock()
        stream = await open_stream(self, generate, *rest)
        now["resumed"] = clock()
        return stream

    run = streams.Stream.run

    class TracedCall:
        def __init__(self, call: Any) -> None:
            self.call = call

        async def initial_metadata(self) -> Any:
            metadata = await self.call.initial_metadata()
            now["initmd"] = clock()
            return metadata

        def __aiter__(self) -> AsyncIterator[Any]:
            return self._messages()

        async def _messages(self) -> AsyncIterator[Any]:
            async for message in self.call:
                now.setdefault("msg1", clock())
                yield message

        def cancel(self) -> bool:
            return bool(self.call.cancel())

    async def traced_run(self: Any, call: Any) -> None:
        now["producer"] = clock()
        await run(self, TracedCall(call))

    send = uvicorn_http.RequestResponseCycle.send

    async def traced_send(self: Any, message: Any) -> None:
        first_body = message["type"] == "http.response.body" and "body_send" not in now
        if message["type"] == "http.response.start":
            now["start_send"] = clock()
        elif first_body:
            now["body_call"] = clock()
        await send(self, message)
        if first_body:
            now["body_send"] = clock()
            if all(step in now for step in STEPS):
                out.write(repr(dict(now)) + "\n")

    from grpc.aio import _call as aio_call

    send_request = aio_call.UnaryStreamCall._send_unary_request

    async def traced_send_request(self: Any) -> None:
        now.setdefault("send", clock())
        await send_request(self)

    aio_call.UnaryStreamCall._send_unary_request = traced_send_request  # type: ignore[method-assign]
    uvicorn_http.HttpToolsProtocol.data_received = traced_data_received  # type: ignore[method-assign]
    serving.GenerateEndpoints.post = traced_post  # type: ignore[method-assign]
    http.read_json = traced_read_json
    serving.GenerateEndpoints.open_stream = traced_open_stream  # type: ignore[method-assign,assignment]
    streams.Stream.run = traced_run  # type: ignore[method-assign]
    uvicorn_http.RequestResponseCycle.send = traced_send  # type: ignore[method-assign]
    return main(argv)


async def first_token(client: Any, tokens: int) -> tuple[float, float]:
    """(sent, first token received) of one SSE generation."""
    start, first = time.perf_counter(), 0.0
    body = {"prompt": PROMPT, "max_tokens": tokens}
    async with client.stream("POST", "/v1/models/codelm/generate", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and not first:
                first = time.perf_counter()
    return start, first


class Traced:
    """One traced process from `tree`'s code: this file with --serve (a gateway) or --serve-sidecar,
    its steps appended to a trace file of its own; `address` is what it logged it serves on."""

    def __init__(self, name: str, mode: str, argv: Sequence[str], tree: Path, trace: Path) -> None:
        from bench.lib.trees import pythonpath
        from bench.processes import SIDECAR_READY, start_announced

        self.name = name
        self.trace = trace
        self.trace.write_text("")
        env = dict(os.environ, EDGE_TRACE=str(self.trace), PYTHONPATH=pythonpath(tree))
        ready = r"serving HTTP on (http://\S+)" if mode == "--serve" else SIDECAR_READY
        self.proc, self.address = start_announced(
            [sys.executable, str(Path(__file__).resolve()), mode, *argv],
            tree,
            env,
            ready,
            f"the traced process {name} ({mode})",
        )

    def steps(self) -> list[dict[str, float]]:
        return [ast.literal_eval(line) for line in self.trace.read_text().splitlines()]

    def stop(self) -> None:
        import signal

        from modelyard.process import children

        children.stop(self.proc, signal.SIGTERM, grace_s=30)


async def run(args: argparse.Namespace) -> None:
    import grpc
    import httpx

    from bench.edge import ROOT, cpu_s, grpc_once
    from bench.stack import Stack
    from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc

    specs = [(name, tree, []) for name, tree in args.trees] + [
        (name, ROOT, flags.split()) for name, flags in args.flags
    ]
    specs = specs or [("now", ROOT, [])]
    stack = Stack()
    traced: list[Traced] = []
    pairs: list[tuple[Traced, Traced]] = []  # (gateway, sidecar) per spec
    try:
        with tempfile.TemporaryDirectory(prefix="edge-trace-") as folder:
            for name, tree, flags in specs:
                # Each spec's own sidecar (from its tree) on the stack's service, and its gateway on it.
                sidecar_argv = ["--listen", "127.0.0.1:0", "--upstream", stack.service, "--admin-listen", ""]
                sidecar = Traced(name, "--serve-sidecar", sidecar_argv, tree, Path(folder, f"{name}.sidecar"))
                traced.append(sidecar)
                gateway_argv = ["--listen", "127.0.0.1:0", "--upstream", sidecar.address, *flags]
                gateway = Traced(name, "--serve", gateway_argv, tree, Path(folder, f"{name}.gateway"))
                traced.append(gateway)
                pairs.append((gateway, sidecar))
            clients = [httpx.AsyncClient(base_url=g.address, timeout=60) for g, _ in pairs]
            async with grpc.aio.insecure_channel(stack.sidecar or stack.service) as channel:
                stub = pb_grpc.InferenceServiceStub(channel)
                for _ in range(3):
                    for client in clients:
                        await first_token(client, args.tokens)
                for process in traced:
                    process.trace.write_text("")
                cpu = [(cpu_s(g.proc.pid), cpu_s(s.proc.pid)) for g, s in pairs]
                sent: list[list[tuple[float, float]]] = [[] for _ in pairs]
                direct: list[float] = []
                turns = list(zip(sent, clients, strict=True))
                for turn in range(args.requests):
                    direct.append((await grpc_once(stub, args.tokens))[0])
                    # Back and forth: neither gateway always follows the other's stream tail.
                    for times, client in turns if turn % 2 == 0 else turns[::-1]:
                        times.append(await first_token(client, args.tokens))
                cpu = [
                    ((cpu_s(g.proc.pid) - gc) / args.requests, (cpu_s(s.proc.pid) - sc) / args.requests)
                    for (g, s), (gc, sc) in zip(pairs, cpu, strict=True)
                ]
            for client in clients:
                await client.aclose()
            table = [
                rows(g.steps(), s.steps(), times, args.dump)
                for (g, s), times in zip(pairs, sent, strict=True)
            ]
    finally:
        for process in traced:
            process.stop()
        stack.stop()
    print(
        f"\nFirst-event path, gateway and sidecar: codelm, {args.tokens} tokens, {args.requests} requests,"
        " concurrency 1"
    )
    print(
        f"the stack's sidecar direct (gRPC) TTFT: median {statistics.median(direct) * 1e3:.3f} ms, "
        f"fastest {min(direct) * 1e3:.3f}"
    )
    names = [g.name for g, _ in pairs]
    print(f"\n{'step (ms)':<40}" + "".join(f"{name + ' med':>13}{name + ' min':>13}" for name in names))
    for label in table[0]:
        print(
            f"{label:<40}"
            + "".join(
                f"{statistics.median(t[label]) * 1e3:>13.3f}{min(t[label]) * 1e3:>13.3f}" for t in table
            )
        )
    print(f"{'gateway CPU per request':<40}" + "".join(f"{c[0] * 1e3:>13.3f}{'':>13}" for c in cpu))
    print(f"{'sidecar CPU per request':<40}" + "".join(f"{c[1] * 1e3:>13.3f}{'':>13}" for c in cpu))


def rows(
    gateway: list[dict[str, float]],
    sidecar: list[dict[str, float]],
    times: list[tuple[float, float]],
    dump: bool = False,
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"client send -> recv": []}
    out.update({f"{a} -> {b}": [] for a, b in itertools.pairwise(CHAIN)})
    out["body_call -> client's first token"] = []
    out.update({f"  beside: {b} -> {step}": [] for step, b in BESIDE})
    out["in the gateway, upstream excluded"] = []
    out["in the sidecar, service excluded"] = []
    out.update({"service (sc.called -> sc.up_msg1)": [], "client TTFT": []})
    if not len(gateway) == len(sidecar) == len(times):
        raise RuntimeError(f"{len(gateway)} and {len(sidecar)} traced requests for {len(times)} sent")
    for g, s, (start, first) in zip(gateway, sidecar, times, strict=True):
        step = {**g, **s}
        if dump:
            order = sorted(step.items(), key=lambda kv: kv[1])
            print(
                " ".join(f"{k} {(v - start) * 1e3:.3f}" for k, v in order),
                f"first {(first - start) * 1e3:.3f}",
            )
        out["client send -> recv"].append(step["recv"] - start)
        for a, b in itertools.pairwise(CHAIN):
            out[f"{a} -> {b}"].append(step[b] - step[a])
        out["body_call -> client's first token"].append(first - step["body_call"])
        for b, a in BESIDE:
            out[f"  beside: {a} -> {b}"].append(step[b] - step[a])
        out["in the gateway, upstream excluded"].append(
            step["body_call"] - step["recv"] - (step["msg1"] - step["parsed"])
        )
        # The service's headers go out before its prefill: its time runs to its first message.
        service = step["sc.up_msg1"] - step["sc.called"]
        out["in the sidecar, service excluded"].append(step["sc.write_call"] - step["sc.entered"] - service)
        out["service (sc.called -> sc.up_msg1)"].append(service)
        out["client TTFT"].append(first - start)
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(serve(sys.argv[2:]))
    if sys.argv[1:2] == ["--serve-sidecar"]:
        sys.exit(serve_sidecar(sys.argv[2:]))
    from bench.edge import _named
    from bench.lib.trees import source_trees

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--trees", type=source_trees, default=[], metavar="NAME=TREE,...")
    parser.add_argument("--flags", type=_named, action="append", default=[], metavar="NAME='FLAGS'")
    parser.add_argument(
        "--dump", action="store_true", help="each request's steps, in the order they happened"
    )
    asyncio.run(run(parser.parse_args()))
