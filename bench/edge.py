"""Edge benchmark: what the HTTP edge adds to a generation, in one run on this machine.

    .venv/bin/python -m bench.edge [--requests 20] [--tokens 32] [--streams 32] [--ttft-only]
        [--raw-client] [--bare-proxy] [--trees NAME=DIR,...] [--flags NAME='FLAGS']
        [--sidecar-trees NAME=DIR,...] [--service-trees NAME=DIR,...]

The stack runs as `make up` runs it (python -m modelyard.deploy: service, the sidecar when installed, gateway,
Envoy; ephemeral ports). At concurrency 1 it measures time to first token (TTFT: request sent to
first token received) and per-token latency (first to last token / (tokens - 1)) for: the service
directly (gRPC), the sidecar (gRPC, when present), a gateway of the bench's own on the service (the
gateway hop without the sidecar), the stack's gateway SSE on the sidecar, and Envoy -> gateway SSE,
taking turns request by request; reported as medians, fastest and ratios to direct, then as the
TTFT each hop adds (the difference of the paths with and without it). `--trees base=DIR,now=DIR`
and `--flags NAME='--flag value'` add gateways on the sidecar from other source trees or with
other flags to the same turns (before/after pairs in one run); `--sidecar-trees base=DIR,now=DIR`
adds, per tree, a sidecar from it on the service and a gateway from it on that sidecar (the sidecar
hop and the gateway + sidecar pair before/after, in the same turns); `--service-trees base=DIR,now=DIR`
adds, per tree, a service from it (the stack's model repository) with this tree's sidecar and gateway
on it, called directly and through that gateway with the lean client (the service's own share of the
chain before/after: direct TTFT, and the chain over it; no Envoy); `--bare-proxy` adds
bench/bare_proxy.py on the service (the sidecar hop's grpc.aio floor); `--ttft-only` stops there.
Then tokens/s with 32 concurrent streams, direct versus the whole chain, and the gateway's resident
memory per held SSE stream (streams opened and left unread, so the gateway holds each one in its
buffer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench.lib.procfs import rss_kib
from bench.lib.trees import pythonpath, source_trees
from bench.processes import SIDECAR_READY, start_announced
from bench.stack import Gateway, Stack
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.process import children

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def __init__(self"
DIRECT, SIDECAR = "service (gRPC, direct)", "sidecar (gRPC)"
BARE = "bare proxy (gRPC)"
RAW = " (raw client)"
WARMUP = 3  # requests per path before the measured turns
GATEWAY, ON_SERVICE = "gateway -> sidecar", "gateway -> service"
Timing = tuple[float, float, int]  # ttft s, per-token s, tokens


def request(tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(model_name="codelm", prompt=PROMPT, max_tokens=tokens)


async def grpc_once(stub: Any, tokens: int) -> Timing:
    start = time.perf_counter()
    first = last = 0.0
    count = 0
    async for response in stub.Generate(request(tokens)):
        if response.token_ids:
            last = time.perf_counter()
            first = first or last
            count += len(response.token_ids)
    return first - start, (last - first) / max(1, count - 1), count


async def sse_once(client: httpx.AsyncClient, tokens: int) -> Timing:
    start = time.perf_counter()
    first = last = 0.0
    count = 0
    body = {"prompt": PROMPT, "max_tokens": tokens}
    async with client.stream("POST", "/v1/models/codelm/generate", json=body) as response:
        event = ""
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "token":
                last = time.perf_counter()
                first = first or last
                count += len(json.loads(line[6:])["token_ids"])
    return first - start, (last - first) / max(1, count - 1), count


class RawSse:
    """A lean HTTP/1.1 client for the SSE generate call (one kept-alive connection, the request in one
    write, chunked body parsed by hand): what the edge adds without httpx's own cost per request,
    which the gRPC paths do not pay (--raw-client)."""

    def __init__(self, url: str, tokens: int) -> None:
        self.host, _, port = url.removeprefix("http://").rstrip("/").rpartition(":")
        self.port = int(port)
        body = json.dumps({"prompt": PROMPT, "max_tokens": tokens}).encode()
        self.request = (
            f"POST /v1/models/codelm/generate HTTP/1.1\r\nhost: {self.host}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def once(self) -> Timing:
        if self.conn is None:
            self.conn = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.conn
        start = time.perf_counter()
        first = last = 0.0
        count = 0
        writer.write(self.request)
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        pending = b""
        while size := int((await reader.readline()).strip(), 16):
            pending += (await reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if b"\nevent: token\n" in event:
                    last = time.perf_counter()
                    first = first or last
                    count += len(json.loads(event.rpartition(b"data: ")[2])["token_ids"])
        await reader.readline()  # the CRLF after the last chunk
        return first - start, (last - first) / max(1, count - 1), count

    async def close(self) -> None:
        if self.conn is not None:
            self.conn[1].close()
            await self.conn[1].wait_closed()


async def measure(
    paths: dict[str, Callable[[], Awaitable[Timing]]], n: int
) -> list[tuple[str, float, float, float]]:
    """Median TTFT and per-token time, and the fastest TTFT, per path; the paths take turns request
    by request (back and forth), so load from elsewhere on the machine falls on all of them alike."""
    for once in paths.values():
        for _ in range(WARMUP):  # warm-up: connections, first-call paths
            await once()
    runs: dict[str, list[Timing]] = {name: [] for name in paths}
    order = list(paths.items())
    for turn in range(n):
        # Every other turn in reverse order: no path always follows the same other one (whose
        # stream's tail, still being cleaned up in its processes, would fall on it).
        for name, once in order if turn % 2 == 0 else order[::-1]:
            runs[name].append(await once())
    return [
        (
            name,
            statistics.median(r[0] for r in got),
            statistics.median(r[1] for r in got),
            min(r[0] for r in got),
        )
        for name, got in runs.items()
    ]


async def throughput(once: Callable[[], Awaitable[Timing]], streams: int, rounds: int = 2) -> float:
    start = time.perf_counter()
    total = 0
    for _ in range(rounds):
        results = await asyncio.gather(*(once() for _ in range(streams)))
        total += sum(r[2] for r in results)
    return total / (time.perf_counter() - start)


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def held_streams(gateway: str, pid: int, count: int) -> tuple[int, float]:
    """Open `count` SSE streams, read each one's first event and stop reading; RSS growth per stream."""
    before = rss_kib(pid)
    limits = httpx.Limits(max_connections=count + 4)
    async with httpx.AsyncClient(base_url=gateway, timeout=120, limits=limits) as client:
        opened: list[httpx.Response] = []
        for _ in range(count):
            req = client.build_request(
                "POST", "/v1/models/codelm/generate", json={"prompt": PROMPT, "max_tokens": 256}
            )
            response = await client.send(req, stream=True)
            opened.append(response)
        await asyncio.sleep(1.0)
        during = rss_kib(pid)
        for response in opened:
            await response.aclose()
    return during - before, (during - before) / count


class Sidecar:
    """One more sidecar process (`python -m modelyard.sidecar`, no admin listener) from `tree`'s code,
    on the stack's service: the sidecar hop from another tree in the same turns (--sidecar-trees)."""

    def __init__(self, upstream: str, tree: Path) -> None:
        env = dict(os.environ, PYTHONPATH=pythonpath(tree))
        cmd = [sys.executable, "-m", "modelyard.sidecar", "--listen", "127.0.0.1:0", "--upstream", upstream]
        self.proc, self.address = start_announced(
            [*cmd, "--admin-listen", ""], tree, env, SIDECAR_READY, f"the sidecar from {tree}"
        )

    def stop(self) -> None:
        children.stop(self.proc, signal.SIGTERM, grace_s=30)


class TreeService:
    """One more service process (`python -m modelyard.service`, the stack's repository) from
    `tree`'s code, with this tree's sidecar and gateway on it (--service-trees)."""

    def __init__(self, tree: Path) -> None:
        env = dict(os.environ, PYTHONPATH=pythonpath(tree))
        cmd = [sys.executable, "-m", "modelyard.service", "--repository", str(ROOT / "models" / "demo")]
        self.proc, self.address = start_announced(
            [*cmd, "--listen", "127.0.0.1:0", "--metrics-listen", ""],
            tree,
            env,
            r"serving gRPC on ([^\s;,]+)",
            f"the service from {tree}",
        )
        self.sidecar: Sidecar | None = None
        self.gateway: Gateway | None = None
        try:
            self.sidecar = Sidecar(self.address, ROOT)
            self.gateway = Gateway(self.sidecar.address)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for part in (self.gateway, self.sidecar):
            if part is not None:
                part.stop()
        children.stop(self.proc, signal.SIGTERM, grace_s=30)


class BareProxy:
    """bench/bare_proxy.py on the stack's service: the grpc.aio floor of the sidecar's hop (bytes,
    metadata and status forwarded, nothing else; gRPC's default windows), in the same turns."""

    def __init__(self, upstream: str) -> None:
        cmd = [sys.executable, "-m", "bench.bare_proxy", "--upstream", upstream, "--listen", "127.0.0.1:0"]
        self.proc: subprocess.Popen[str] = children.popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert self.proc.stdout is not None
        lines = children.ReadyLine(re.compile(r"bare proxy serving gRPC on (\S+)"))
        if not children.follow(self.proc.stdout, lines).wait(60) or lines.match is None:
            self.stop()
            raise RuntimeError("the bare proxy did not start")
        self.address = lines.match.group(1)

    def stop(self) -> None:
        children.stop(self.proc, signal.SIGTERM, grace_s=30)


def sidecar_name(name: str) -> str:
    return f"sidecar[{name}] (gRPC)"


def pair_name(name: str) -> str:
    return f"gateway[{name}] -> sidecar[{name}]"


def extra_gateways(stack: Stack, args: argparse.Namespace) -> dict[str, Gateway]:
    """The gateways the bench starts beside the stack's: one on the service itself (the gateway hop
    without the sidecar), and one per --trees / --flags entry on the sidecar (before/after pairs)."""
    upstream = stack.sidecar or stack.service
    out: dict[str, Gateway] = {}
    try:
        if stack.sidecar:
            out[ON_SERVICE] = Gateway(stack.service)
        for name, tree in args.trees:
            out[f"gateway[{name}] -> sidecar"] = Gateway(upstream, tree)
        for name, flags in args.flags:
            out[f"gateway[{name}] -> sidecar"] = Gateway(upstream, ROOT, flags.split())
    except BaseException:
        for gateway in out.values():
            gateway.stop()
        raise
    return out


def service_name(name: str) -> str:
    return f"service[{name}] (gRPC, direct)"


def on_service_name(name: str) -> str:
    return f"gateway -> sidecar -> service[{name}]" + RAW


def hops(
    rows: dict[str, Any],
    gateway: str,
    edge: str,
    sidecar_trees: Sequence[str] = (),
    service_trees: Sequence[str] = (),
) -> list[tuple[str, str, str]]:
    """Each hop as the difference of the paths with and without it: (hop, path, path below it)."""
    out = [
        ("sidecar", SIDECAR, DIRECT),
        ("bare proxy", BARE, DIRECT),
        ("sidecar over bare proxy", SIDECAR, BARE),
    ]
    out += [("gateway on the service", ON_SERVICE, DIRECT)]
    for name in sidecar_trees:
        out += [
            (f"sidecar[{name}]", sidecar_name(name), DIRECT),
            (f"gateway+sidecar[{name}]", pair_name(name), DIRECT),
        ]
    for name in service_trees:
        out += [(f"chain over service[{name}]", on_service_name(name), service_name(name))]
    for name in service_trees[1:]:  # each tree's service against the first tree's, directly and chained
        first = service_trees[0]
        out += [
            (f"service[{name}] - [{first}]", service_name(name), service_name(first)),
            (f"chain[{name}] - [{first}]", on_service_name(name), on_service_name(first)),
        ]
    out += [
        ("gateway on the sidecar", GATEWAY, SIDECAR),
        ("Envoy", edge, gateway),
        ("whole chain", edge, DIRECT),
        ("whole chain, raw client", edge + RAW, DIRECT),
    ]
    return [hop for hop in out if hop[1] in rows and hop[2] in rows]


async def main(args: argparse.Namespace) -> None:
    stack = Stack()
    extra: dict[str, Gateway] = {}
    sidecars: dict[str, Sidecar] = {}
    services: dict[str, TreeService] = {}
    bare: BareProxy | None = None
    try:
        extra = extra_gateways(stack, args)
        if args.bare_proxy:
            bare = BareProxy(stack.service)
        for name, tree in args.sidecar_trees:
            sidecars[name] = Sidecar(stack.service, tree)
            extra[pair_name(name)] = Gateway(sidecars[name].address, tree)
        for name, tree in args.service_trees:
            services[name] = TreeService(tree)
        limits = httpx.Limits(max_connections=args.streams + 4)
        async with contextlib.AsyncExitStack() as clients:
            channel = await clients.enter_async_context(grpc.aio.insecure_channel(stack.service))
            side = await clients.enter_async_context(
                grpc.aio.insecure_channel(stack.sidecar or stack.service)
            )
            gw = await clients.enter_async_context(httpx.AsyncClient(base_url=stack.gateway, timeout=60))
            edge = await clients.enter_async_context(
                httpx.AsyncClient(base_url=stack.edge, timeout=120, limits=limits)
            )
            direct = pb_grpc.InferenceServiceStub(channel)
            sidecar = pb_grpc.InferenceServiceStub(side)
            paths: dict[str, Callable[[], Awaitable[Timing]]] = {
                DIRECT: lambda: grpc_once(direct, args.tokens)
            }
            if stack.sidecar:
                paths[SIDECAR] = lambda: grpc_once(sidecar, args.tokens)
            if bare is not None:
                bare_channel = await clients.enter_async_context(grpc.aio.insecure_channel(bare.address))
                paths[BARE] = functools.partial(
                    grpc_once, pb_grpc.InferenceServiceStub(bare_channel), args.tokens
                )
            for name, tree_sidecar in sidecars.items():
                tree_channel = await clients.enter_async_context(
                    grpc.aio.insecure_channel(tree_sidecar.address)
                )
                paths[sidecar_name(name)] = functools.partial(
                    grpc_once, pb_grpc.InferenceServiceStub(tree_channel), args.tokens
                )
            for name, tree_service in services.items():
                service_channel = await clients.enter_async_context(
                    grpc.aio.insecure_channel(tree_service.address)
                )
                paths[service_name(name)] = functools.partial(
                    grpc_once, pb_grpc.InferenceServiceStub(service_channel), args.tokens
                )
                assert tree_service.gateway is not None
                raw = RawSse(tree_service.gateway.url, args.tokens)
                clients.push_async_callback(raw.close)
                paths[on_service_name(name)] = raw.once
            for name, gateway in extra.items():
                client = await clients.enter_async_context(
                    httpx.AsyncClient(base_url=gateway.url, timeout=60)
                )
                paths[name] = functools.partial(sse_once, client, args.tokens)
            gateway_path = GATEWAY if stack.sidecar else ON_SERVICE
            edge_path = "Envoy -> " + gateway_path
            paths[gateway_path] = lambda: sse_once(gw, args.tokens)
            paths[edge_path] = lambda: sse_once(edge, args.tokens)
            if args.raw_client:
                for path, url in ((gateway_path, stack.gateway), (edge_path, stack.edge)):
                    raw = RawSse(url, args.tokens)
                    clients.push_async_callback(raw.close)
                    paths[path + RAW] = raw.once
            # Each gateway's own CPU time over the turns, per request it served: steadier than
            # wall-clock TTFT on a loaded machine, and what a change to the gateway's path moves.
            stack_gateway = stack.gateway_pid()
            served = {stack_gateway: sum(1 for name in paths if name.startswith((gateway_path, edge_path)))}
            served.update({gateway.pid: 1 for gateway in extra.values()})
            cpu_at = {pid: cpu_s(pid) for pid in served}
            rows = await measure(paths, args.requests)
            gateway_cpu_ms = {
                pid: (cpu_s(pid) - cpu_at[pid]) * 1e3 / (count * (args.requests + WARMUP))
                for pid, count in served.items()
            }
            if not args.ttft_only:
                direct_tps = await throughput(lambda: grpc_once(direct, args.tokens), args.streams)
                gateway_pid = stack.gateway_pid()
                cpu_before, started = cpu_s(gateway_pid), time.perf_counter()
                chain_tps = await throughput(lambda: sse_once(edge, args.tokens), args.streams)
                gateway_cpu = (cpu_s(gateway_pid) - cpu_before) / (
                    chain_tps * (time.perf_counter() - started)
                )
        if not args.ttft_only:
            held, per_stream = await held_streams(stack.gateway, stack.gateway_pid(), args.held)
    finally:
        for gateway in extra.values():
            gateway.stop()
        for tree_sidecar in sidecars.values():
            tree_sidecar.stop()
        for tree_service in services.values():
            tree_service.stop()
        if bare is not None:
            bare.stop()
        stack.stop()
    base_ttft, base_tok, base_min = rows[0][1], rows[0][2] or 1.0, rows[0][3]  # 1 token: no per-token time
    chain = "Envoy -> gateway -> sidecar -> service" if stack.sidecar else "Envoy -> gateway -> service"
    print(f"\nEdge benchmark: codelm, {args.tokens} tokens, greedy, {args.requests} requests, concurrency 1")
    print(f"chain measured: {chain}\n")
    wide = max([42, *(len(name) + 2 for name, *_ in rows)])
    print(
        f"{'path':<{wide}}{'TTFT ms':>9}{'x direct':>9}{'+ms':>7}{'min ms':>8}{'+ms':>7}"
        f"{'per-token ms':>13}{'x direct':>9}"
    )
    for name, ttft, tok, least in rows:
        print(
            f"{name:<{wide}}{ttft * 1e3:>9.2f}{ttft / base_ttft:>9.2f}{(ttft - base_ttft) * 1e3:>7.2f}"
            f"{least * 1e3:>8.2f}{(least - base_min) * 1e3:>7.2f}{tok * 1e3:>13.3f}{tok / base_tok:>9.2f}"
        )
    print(f"\ngateway CPU per request ({args.tokens} tokens), its own process:")
    for name, gateway in extra.items():
        print(f"  {name:<30}{gateway_cpu_ms[gateway.pid]:>7.3f} ms")
    print(f"  {'the stack' + chr(39) + 's (its paths together)':<30}{gateway_cpu_ms[stack_gateway]:>7.3f} ms")
    by_name = {name: (ttft, tok, least) for name, ttft, tok, least in rows}
    added = hops(by_name, gateway_path, edge_path, list(sidecars), list(services))
    wide = max([24, *(len(hop) + 2 for hop, *_ in added)])
    print(f"\n{'TTFT added by each hop':<{wide}}{'median +ms':>11}{'fastest +ms':>12}  (path minus path)")
    for hop, path, below in added:
        median = (by_name[path][0] - by_name[below][0]) * 1e3
        fastest = (by_name[path][2] - by_name[below][2]) * 1e3
        print(f"{hop:<{wide}}{median:>11.2f}{fastest:>12.2f}  ({path} minus {below})")
    if args.ttft_only:
        return
    print(
        f"\n{args.streams} concurrent streams: direct {direct_tps:,.0f} tokens/s, "
        f"chain {chain_tps:,.0f} tokens/s ({chain_tps / direct_tps:.2f} x direct)"
    )
    print(f"gateway CPU per streamed token at {args.streams} streams: {gateway_cpu * 1e3:.3f} ms")
    print(f"gateway RSS with {args.held} held SSE streams: +{held} KiB, {per_stream:.1f} KiB per stream")


def _named(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--held", type=int, default=64)
    parser.add_argument(
        "--raw-client",
        action="store_true",
        help="the stack's gateway and Envoy once more with a lean HTTP client",
    )
    parser.add_argument(
        "--ttft-only", action="store_true", help="time to first token only (no throughput, memory)"
    )
    parser.add_argument(
        "--trees", type=source_trees, default=[], metavar="NAME=TREE,...",
        help="one more gateway on the sidecar from each source tree (a git worktree), taking turns",
    )  # fmt: skip
    parser.add_argument(
        "--bare-proxy",
        action="store_true",
        help="a bare grpc.aio proxy on the service too (the sidecar's floor)",
    )
    parser.add_argument(
        "--sidecar-trees", type=source_trees, default=[], metavar="NAME=TREE,...",
        help="one more sidecar on the service, and a gateway on it, from each source tree, taking turns",
    )  # fmt: skip
    parser.add_argument(
        "--service-trees", type=source_trees, default=[], metavar="NAME=TREE,...",
        help="one more service from each source tree, with a sidecar and a gateway on it, taking turns",
    )  # fmt: skip
    parser.add_argument(
        "--flags", type=_named, action="append", default=[], metavar="NAME='FLAGS'",
        help="one more gateway on the sidecar with these flags (repeatable), taking turns",
    )  # fmt: skip
    asyncio.run(main(parser.parse_args()))
