"""Where a gateway's time to first token goes, step by step, in one run:

    .venv/bin/python -m bench.edge_trace [--trees base=DIR,now=DIR] [--flags NAME='FLAGS'] [--requests 40]

The stack runs as for bench.edge; beside it, one gateway per --trees / --flags entry (default: this
tree's) on the sidecar, each run by this file with timestamps at each step of the SSE first-event
path. time.perf_counter is CLOCK_MONOTONIC on Linux, one clock for every process, so the client's
send and first token line up with the gateway's steps. The gateways take turns request by request,
back and forth (with a direct call to the sidecar in each turn, for reference); the table gives
each step's median and fastest per gateway, and each gateway's CPU per request.

Steps: recv (the request's bytes reach uvicorn) -> handler (the SSE endpoint is entered: uvicorn's
task, Starlette's middleware and routing) -> body (read) -> parsed (parse_generate) -> producer
(the upstream call made, the stream registered, its producer task running) -> initmd (the
upstream's initial metadata) -> msg1 (its first message) -> resumed (the first event buffered,
the handler woken) -> start_send (the response headers) -> body_call -> body_send (the first
event's bytes written to the socket).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

STEPS = (
    "recv",
    "handler",
    "body",
    "parsed",
    "producer",
    "initmd",
    "msg1",
    "resumed",
    "start_send",
    "body_call",
    "body_send",
)
PROMPT = "def __init__(self"


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

    async def traced_open_stream(self: Any, generate: Any, metadata: Any) -> Any:
        now["parsed"] = clock()
        stream = await open_stream(self, generate, metadata)
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

    uvicorn_http.HttpToolsProtocol.data_received = traced_data_received  # type: ignore[method-assign]
    serving.GenerateEndpoints.post = traced_post  # type: ignore[method-assign]
    http.read_json = traced_read_json
    serving.GenerateEndpoints.open_stream = traced_open_stream  # type: ignore[method-assign]
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


class TracedGateway:
    def __init__(self, name: str, upstream: str, tree: Path, flags: Sequence[str], folder: Path) -> None:
        import re

        from modelyard.process import children

        self.name = name
        self.trace = folder / f"{name}.txt"
        self.trace.write_text("")
        env = dict(os.environ, EDGE_TRACE=str(self.trace), PYTHONPATH=str(tree / "proto" / "python"))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", "--listen", "127.0.0.1:0"]
        self.proc: subprocess.Popen[str] = children.popen(
            [*cmd, "--upstream", upstream, *flags],
            cwd=tree,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stderr is not None
        lines = children.ReadyLine(re.compile(r"serving HTTP on (http://\S+)"))
        if not children.follow(self.proc.stderr, lines).wait(60) or lines.match is None:
            self.stop()
            raise RuntimeError(f"the traced gateway {name} did not start")
        self.url = lines.match.group(1)

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
    gateways: list[TracedGateway] = []
    try:
        with tempfile.TemporaryDirectory(prefix="edge-trace-") as folder:
            upstream = stack.sidecar or stack.service
            for name, tree, flags in specs:
                gateways.append(TracedGateway(name, upstream, tree, flags, Path(folder)))
            clients = [httpx.AsyncClient(base_url=g.url, timeout=60) for g in gateways]
            async with grpc.aio.insecure_channel(upstream) as channel:
                stub = pb_grpc.InferenceServiceStub(channel)
                for _ in range(3):
                    for client in clients:
                        await first_token(client, args.tokens)
                for gateway in gateways:
                    gateway.trace.write_text("")
                cpu = [cpu_s(g.proc.pid) for g in gateways]
                sent: list[list[tuple[float, float]]] = [[] for _ in gateways]
                direct: list[float] = []
                turns = list(zip(sent, clients, strict=True))
                for turn in range(args.requests):
                    direct.append((await grpc_once(stub, args.tokens))[0])
                    # Back and forth: neither gateway always follows the other's stream tail.
                    for times, client in turns if turn % 2 == 0 else turns[::-1]:
                        times.append(await first_token(client, args.tokens))
                cpu = [(cpu_s(g.proc.pid) - c) / args.requests for g, c in zip(gateways, cpu, strict=True)]
            for client in clients:
                await client.aclose()
            table = [rows(gateway.steps(), times) for gateway, times in zip(gateways, sent, strict=True)]
    finally:
        for gateway in gateways:
            gateway.stop()
        stack.stop()
    print(
        f"\nGateway first-event path: codelm, {args.tokens} tokens, {args.requests} requests, concurrency 1"
    )
    print(
        f"sidecar direct (gRPC) TTFT: median {statistics.median(direct) * 1e3:.3f} ms, "
        f"fastest {min(direct) * 1e3:.3f}"
    )
    print(f"\n{'step (ms)':<36}" + "".join(f"{g.name + ' med':>13}{g.name + ' min':>13}" for g in gateways))
    for label in table[0]:
        print(
            f"{label:<36}"
            + "".join(
                f"{statistics.median(t[label]) * 1e3:>13.3f}{min(t[label]) * 1e3:>13.3f}" for t in table
            )
        )
    print(f"{'gateway CPU per request':<36}" + "".join(f"{c * 1e3:>13.3f}{'':>13}" for c in cpu))


def rows(steps: list[dict[str, float]], times: list[tuple[float, float]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"client send -> recv": []}
    out.update({f"{a} -> {b}": [] for a, b in itertools.pairwise(STEPS)})
    out.update({"body_send -> client's first token": [], "start_send -> client's first token": []})
    out["in the gateway, upstream excluded"] = []
    out.update({"upstream (producer -> msg1)": [], "client TTFT": []})
    if len(steps) != len(times):
        raise RuntimeError(f"{len(steps)} traced requests for {len(times)} sent")
    for step, (start, first) in zip(steps, times, strict=True):
        out["client send -> recv"].append(step["recv"] - start)
        for a, b in itertools.pairwise(STEPS):
            out[f"{a} -> {b}"].append(step[b] - step[a])
        upstream = step["msg1"] - step["producer"]
        out["body_send -> client's first token"].append(first - step["body_send"])
        out["start_send -> client's first token"].append(first - step["start_send"])
        out["in the gateway, upstream excluded"].append(step["body_send"] - step["recv"] - upstream)
        out["upstream (producer -> msg1)"].append(upstream)
        out["client TTFT"].append(first - start)
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(serve(sys.argv[2:]))
    from bench.edge import _named, _trees

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--trees", type=_trees, default=[], metavar="NAME=TREE,...")
    parser.add_argument("--flags", type=_named, action="append", default=[], metavar="NAME='FLAGS'")
    asyncio.run(run(parser.parse_args()))
