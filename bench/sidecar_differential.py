"""A differential run of the sidecar: each tree's `python -m modelyard.sidecar` (one after the
other, each from its own tree: bench.lib.trees) in front of the same scripted fake upstreams,
sent the same scripted calls, and everything observable compared: each answer (status code,
message, response, initial and trailing metadata), what the upstreams received (version, dye,
trace headers), the spans exported to an OTLP receiver in this process (names, kinds, status,
attributes), the admin views (GET /canary, /breakers, /rollouts) and the request counters of
GET /metrics. It prints every difference and exits 1 if there is one.

The script: dyed calls by fixed users (stable, canary, pinned, a bad weight header), canary
faults answered by stable, a canary's refusal replayed on stable (answered, and refused by both:
`replayed`), a canary fault before a response stream's first message (retried) and after it
(not), client streams, shadows of stable answers (unary and a greedy Generate), the canary's
breaker tripping (and its effective weight 0), an admin weight change and a rollout stepping.
Random ids (trace and span ids, timestamps, durations) are left out of the comparison.

    .venv/bin/python -m bench.sidecar_differential --trees base=/work/wt/base,now=.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench.lib.trees import pythonpath, source_trees
from bench.processes import ROOT
from modelyard.common import health
from modelyard.inference.v1 import inference_service_pb2 as ipb
from modelyard.inference.v1 import model_service_pb2 as mpb
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.sidecar.dyeing import bucket

MODEL = "m"
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
GENERATE = "/modelyard.inference.v1.InferenceService/Generate"
ROUTES = """
stickiness_header: x-user-id
models:
  m: {canary_weight: 50}
breaker: {min_calls: 4, consecutive_faults: 3, error_rate: 0.5, canary_error_rate: 0.5,
          backoff_s: 600, backoff_max_s: 600}
shadow: {share: 100, max_in_flight: 64}
"""
_READY = re.compile(r"sidecar serving gRPC on (\S+?), admin on (http://\S+);")
# What a comparison leaves out: random ids, times, durations, the process's own numbers.
_VOLATILE_KEYS = re.compile(
    r"(trace|span)_?id|time|_at$|^at$|_s$|latency|duration|since|until|pid|changed_by|started|detail", re.I
)
_PEER = re.compile(r"peer:[\d.]+:\d+")
# The upstream's behaviour, by the request's id (KServe) or prompt (Generate): each version's.
FAULTS = {
    "canary-fault": {"2": ("INTERNAL", "model_failed")},
    "rejected": {"2": ("FAILED_PRECONDITION", "model_rejected")},
    "rejected-by-both": {
        "1": ("FAILED_PRECONDITION", "model_rejected"),
        "2": ("FAILED_PRECONDITION", "model_rejected"),
    },
    "invalid": {"1": ("INVALID_ARGUMENT", "invalid_argument"), "2": ("INVALID_ARGUMENT", "invalid_argument")},
}


class Upstream:
    """A fake service serving MODEL versions 1 and 2: ModelInfer, ModelStreamInfer and Generate
    answered by script (FAULTS), WatchModels and health; it records what each call received."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []

    def record(self, path: str, version: str, context: Any, what: str) -> None:
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        self.received.append(
            {
                "path": path,
                "what": what,
                "version": version,
                "x-model-version": md.get("x-model-version"),
                "x-model-dye": md.get("x-model-dye"),
                "traceparent": "traceparent" in md,
                "baggage": md.get("baggage"),
                "x-user-id": md.get("x-user-id"),
            }
        )

    @staticmethod
    def version_of(field: str, context: Any) -> str:
        md = dict(context.invocation_metadata())
        return field or str(md.get("x-model-version", "")) or "1"

    async def fault(self, what: str, version: str, context: Any) -> None:
        found = FAULTS.get(what.split(":")[0], {}).get(version)
        if found is not None:
            code, reason = found
            await context.abort(grpc.StatusCode[code], f"{what} on {version}", (("x-error-reason", reason),))

    async def infer(self, request: bytes, context: Any) -> bytes:
        message = kpb.ModelInferRequest.FromString(request)
        version = self.version_of(message.model_version, context)
        self.record(INFER, version, context, message.id)
        await self.fault(message.id, version, context)
        context.set_trailing_metadata((("x-served-version", version), ("x-run-us", "1000")))
        answer = kpb.ModelInferResponse(model_name=MODEL, model_version=version, id=message.id)
        return answer.SerializeToString()

    async def stream_infer(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for request in requests:
            message = kpb.ModelInferRequest.FromString(request)
            version = self.version_of(message.model_version, context)
            self.record(STREAM_INFER, version, context, message.id)
            answer = kpb.ModelInferResponse(model_name=MODEL, model_version=version, id=message.id)
            yield kpb.ModelStreamInferResponse(infer_response=answer).SerializeToString()

    async def generate(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        message = ipb.GenerateRequest.FromString(request)
        version = self.version_of(message.model_version, context)
        self.record(GENERATE, version, context, message.prompt)
        if not message.prompt.endswith(":late"):
            await self.fault(message.prompt, version, context)  # before the first message
        await context.send_initial_metadata((("x-served-version", version),))
        for n in range(3):
            yield ipb.GenerateResponse(
                sequence_number=n, model_version=version, token_ids=[n]
            ).SerializeToString()
        await self.fault(message.prompt, version, context)  # after them (":late")

    async def watch(self, request: Any, context: Any) -> AsyncIterator[mpb.WatchModelsResponse]:
        await context.send_initial_metadata((("x-initial-state-count", "2"),))
        for version in ("1", "2"):
            yield mpb.WatchModelsResponse(model_name=MODEL, version=version, state=mpb.MODEL_STATE_READY)
        await asyncio.Event().wait()  # the state holds

    async def start(self) -> tuple[grpc.aio.Server, str]:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.new_servicer(), server)
        handlers = {
            "ModelInfer": grpc.unary_unary_rpc_method_handler(self.infer),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(self.stream_infer),
        }
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler("inference.GRPCInferenceService", handlers),
                grpc.method_handlers_generic_handler(
                    "modelyard.inference.v1.InferenceService",
                    {"Generate": grpc.unary_stream_rpc_method_handler(self.generate)},
                ),
                grpc.method_handlers_generic_handler(
                    "modelyard.inference.v1.ModelService",
                    {
                        "WatchModels": grpc.unary_stream_rpc_method_handler(
                            self.watch,
                            request_deserializer=mpb.WatchModelsRequest.FromString,
                            response_serializer=mpb.WatchModelsResponse.SerializeToString,
                        )
                    },
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, f"127.0.0.1:{port}"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP receiver: the spans the sidecar exports, as comparable dicts."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []

    async def Export(self, request: Any, context: Any) -> Any:
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    attributes = {a.key: _value(a.value) for a in span.attributes}
                    self.spans.append(
                        {
                            "name": span.name,
                            "kind": span.kind,
                            "status": span.status.code,
                            "has_parent": bool(span.parent_span_id),
                            "attributes": _stable(attributes),
                            "events": [e.name for e in span.events],
                        }
                    )
        return trace_service_pb2.ExportTraceServiceResponse()


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


def _stable(found: Any) -> Any:
    """`found` without what differs from run to run (see _VOLATILE_KEYS)."""
    if isinstance(found, dict):
        return {k: _stable(v) for k, v in sorted(found.items()) if not _VOLATILE_KEYS.search(str(k))}
    if isinstance(found, list):
        return [_stable(v) for v in found]
    if isinstance(found, str):
        return _PEER.sub("peer:*", found)  # who changed something: the admin client's own port
    return found


def _metadata(md: Any) -> list[tuple[str, str]]:
    return sorted((k, v) for k, v in (md or ()) if isinstance(v, str) and k not in ("date",))


async def _unary(channel: grpc.aio.Channel, body: bytes, md: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    call = channel.unary_unary(INFER, None, None)(body, metadata=md, timeout=10)
    try:
        response = kpb.ModelInferResponse.FromString(await call)
        answer: dict[str, Any] = {"code": "OK", "version": response.model_version, "id": response.id}
    except grpc.aio.AioRpcError as exc:
        answer = {"code": exc.code().name, "details": exc.details()}
    answer["initial"] = _metadata(await call.initial_metadata())
    answer["trailing"] = _metadata(await call.trailing_metadata())
    return answer


async def _stream(call: Any) -> dict[str, Any]:
    messages: list[Any] = []
    try:
        async for message in call:
            messages.append(message)
        answer: dict[str, Any] = {"code": "OK"}
    except grpc.aio.AioRpcError as exc:
        answer = {"code": exc.code().name, "details": exc.details()}
    answer["messages"] = messages
    answer["initial"] = _metadata(await call.initial_metadata())
    answer["trailing"] = _metadata(await call.trailing_metadata())
    return answer


def _infer_request(request_id: str, version: str = "") -> bytes:
    return kpb.ModelInferRequest(model_name=MODEL, model_version=version, id=request_id).SerializeToString()


def _admin(url: str, path: str, method: str = "GET", body: object = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            raw = answer.read()
    except urllib.error.HTTPError as exc:
        raw = exc.read()
    return raw.decode() if path == "/metrics" else json.loads(raw)


def _counters(text: str) -> list[str]:
    """The sidecar's request, attempt, fallback, shadow and refusal counters, as exposed."""
    return sorted(
        line
        for line in text.splitlines()
        if line.startswith("modelyard_sidecar_") and "_total{" in line and "_created" not in line
    )


async def _until(check: Callable[[], Awaitable[bool]], what: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)


async def script(channel: grpc.aio.Channel, admin: Callable[..., Awaitable[Any]]) -> list[Any]:
    """The scripted calls, in order; what each gave."""
    seen: list[Any] = []

    async def infer(
        request_id: str,
        user: str,
        version: str = "",
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        md = (("x-user-id", user), ("x-request-id", request_id), *(headers or {}).items())
        body = _infer_request(request_id, version) if body is None else body
        seen.append(["infer", request_id, user, await _unary(channel, body, md)])

    async def generate(prompt: str, user: str) -> None:
        request = ipb.GenerateRequest(model_name=MODEL, prompt=prompt, max_tokens=3).SerializeToString()
        call = channel.unary_stream(GENERATE, None, None)(
            request, metadata=(("x-user-id", user),), timeout=10
        )
        answer = await _stream(call)
        answer["messages"] = [ipb.GenerateResponse.FromString(m).model_version for m in answer["messages"]]
        seen.append(["generate", prompt, user, answer])

    async def stream_infer(ids: list[str], user: str) -> None:
        async def requests() -> AsyncIterator[bytes]:
            for request_id in ids:
                yield _infer_request(request_id)

        call = channel.stream_stream(STREAM_INFER, None, None)(
            requests(), metadata=(("x-user-id", user),), timeout=10
        )
        answer = await _stream(call)
        answer["messages"] = [
            kpb.ModelStreamInferResponse.FromString(m).infer_response.model_version
            for m in answer["messages"]
        ]
        seen.append(["stream", ids, user, answer])

    users = [f"user-{n}" for n in range(24)]  # some dyed stable, some canary (weight 50)
    for user in users:
        await infer("ok", user)
    await infer("ok", "user-0", version="2")  # pinned
    await infer("ok", "user-0", version="7")  # a pin nobody serves
    await infer("ok", "user-0", headers={"x-canary-weight": "101"})  # a bad weight header: refused
    await infer("ok", "user-0", headers={"x-canary-weight": "100"})  # the caller's own weight
    await infer(
        "ok", "user-0", headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    )
    await infer("ok", "user-0", body=b"", headers={"x-model-name": "bad name!"})  # refused by the name rule
    await infer("ok", "user-0", body=b"\x0a\xff")  # not a message: refused
    some = users[:8]  # stable and canary users (0, 6 and 7 are canary at 50)
    for user in some:
        await infer("invalid", user)  # the request's fault: no fallback, no breaker fault
        await infer("rejected", user)  # the canary's refusal replayed on stable, answered
        await infer("rejected-by-both", user)  # refused by both: `replayed`, nobody charged
    for user in some:
        await generate("ok", user)
        await generate("canary-fault", user)  # before the first message: retried on stable
        await generate("canary-fault:late", user)  # after it: the error is the answer
        await stream_infer(["s1", "s2"], user)
    await asyncio.sleep(0.5)  # the shadows (in the background) finish
    seen.append(["canary", await admin("/canary")])
    seen += await rollout(users, infer, admin)
    for user in users:  # the canary's faults: stable answers, its breaker trips
        await infer("canary-fault", user)
    seen.append(["breakers", await admin("/breakers")])
    seen.append(["canary", await admin("/canary")])
    for user in users:  # effective weight 0: every user dyed stable, none told of a fallback
        await infer("ok", user)
    await infer("ok", "user-1", headers={"x-canary-weight": "100"})  # asked for the canary: breaker-open
    seen.append(["put", await admin("/canary/m", "PUT", {"canary_weight": 10})])
    seen.append(["canary", await admin("/canary")])
    seen.append(["rollouts", await admin("/rollouts")])
    seen.append(["metrics", _counters(await admin("/metrics"))])
    return seen


async def rollout(
    users: list[str], infer: Callable[..., Awaitable[None]], admin: Callable[..., Awaitable[Any]]
) -> list[Any]:
    """A rollout stepping from 20 to 60 (of 20, 60, 100): each step waited for, its calls sent in
    an order that ends with its canary calls (so that the driver's tick, which steps once it has
    seen them, cannot fall inside a step's calls), then aborted."""
    seen: list[Any] = []

    async def at(weight: float) -> None:
        async def there() -> bool:
            found = await admin("/rollouts/m")
            return bool(found.get("weight") == weight)

        await _until(there, f"the rollout at {weight}")
        seen.append(["rollout", await admin("/rollouts/m")])

    canary_at_20 = [u for u in users if bucket(u, MODEL) < 20 * 100]
    spec = {
        "steps": [20, 60, 100],
        "dwell_s": 0,
        "min_calls": len(canary_at_20),
        "judge_calls": len(canary_at_20),
    }
    spec.update(max_latency_ratio=1000, latency_floor_s=3600)  # no gate on timing
    started = await admin("/rollouts/m", "POST", spec)
    seen.append(["start", started])
    await at(20)
    for user in sorted(users, key=lambda u: u in canary_at_20):
        await infer("ok", user)
    await at(60)
    for user in users:
        await infer("ok", user)
    seen.append(["abort", await admin("/rollouts/m/abort", "POST", {})])
    seen.append(["rollout", await admin("/rollouts/m")])
    return seen


async def run_tree(label: str, tree: Path, workdir: Path, upstream: Upstream, address: str) -> dict[str, Any]:
    upstream.received = []
    receiver = Receiver()
    otlp = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, otlp)
    otlp_port = otlp.add_insecure_port("127.0.0.1:0")
    await otlp.start()
    routes = workdir / f"{label}-routes.yaml"
    routes.write_text(ROUTES)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODELYARD_", "OTEL_"))}
    env.update(
        PYTHONPATH=pythonpath(tree),
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{otlp_port}",
        OTEL_TRACES_SAMPLER="always_on",
        OTEL_BSP_SCHEDULE_DELAY="50",
    )
    cmd = [sys.executable, "-m", "modelyard.sidecar", "--listen", "127.0.0.1:0", "--admin-listen"]
    cmd += ["127.0.0.1:0", "--admin-open", "--upstream", address, "--config", str(routes)]
    proc = await asyncio.create_subprocess_exec(
        *cmd, cwd=workdir, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stderr is not None
        log: list[str] = []
        while True:
            line = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()
            if not line:
                raise RuntimeError(f"{label}'s sidecar did not start:\n" + "".join(log))
            log.append(line)
            if (ready := _READY.search(line)) is not None:
                break
        listen, admin_url = ready.group(1), ready.group(2)
        drain = asyncio.ensure_future(_drain(proc.stderr))

        async def admin(path: str, method: str = "GET", body: object = None) -> Any:
            return _stable(await asyncio.to_thread(_admin, admin_url, path, method, body))

        async def known() -> bool:
            found = await admin("/canary")
            return bool(found) and "2" in json.dumps(found)

        await _until(known, "the sidecar knows the canary")
        async with grpc.aio.insecure_channel(listen) as channel:
            seen = await script(channel, admin)
        await asyncio.sleep(0.5)  # the last spans exported
        return {"answers": seen, "received": upstream.received, "spans": receiver.spans}
    finally:
        proc.terminate()
        await proc.wait()
        if "drain" in locals():
            drain.cancel()
        await otlp.stop(0)


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


async def both(trees: tuple[tuple[str, Path], ...], workdir: Path) -> dict[str, dict[str, Any]]:
    """Each tree's run, one after the other, in front of the same upstream (one address: the
    spans' and breakers' upstream is the same)."""
    upstream = Upstream()
    server, address = await upstream.start()
    try:
        return {label: await run_tree(label, tree, workdir, upstream, address) for label, tree in trees}
    finally:
        await server.stop(0)


def differences(base: Any, now: Any, where: str = "") -> list[str]:
    if isinstance(base, dict) and isinstance(now, dict):
        found = []
        for key in sorted(set(base) | set(now), key=str):
            found += differences(base.get(key), now.get(key), f"{where}.{key}")
        return found
    if isinstance(base, list) and isinstance(now, list):
        if len(base) != len(now):
            pairs = enumerate(zip(base, now, strict=False))
            first = [f"{where}[{i}]: {b!r} vs {n!r}" for i, (b, n) in pairs if b != n][:5]
            return [f"{where}: {len(base)} items vs {len(now)}", *first]
        found = []
        for i, (b, n) in enumerate(zip(base, now, strict=True)):
            found += differences(b, n, f"{where}[{i}]")
        return found
    return [] if base == now else [f"{where}: {base!r} vs {now!r}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", type=source_trees, default=source_trees(f"base={ROOT},now={ROOT}"))
    parser.add_argument("--dump", type=Path, default=None, help="write both runs here (JSON)")
    args = parser.parse_args(argv)
    (base_label, base_tree), (now_label, now_tree) = args.trees[:2]
    with tempfile.TemporaryDirectory() as tmp:
        runs = asyncio.run(both(((base_label, base_tree), (now_label, now_tree)), Path(tmp)))
    base, now = runs[base_label], runs[now_label]
    # Spans are exported in batches, and shadow calls reach the upstream in the background:
    # both compared as multisets, in a stable order.
    for run in (base, now):
        for key in ("spans", "received"):
            run[key] = sorted(run[key], key=lambda s: json.dumps(s, sort_keys=True))
    if args.dump is not None:
        args.dump.write_text(json.dumps(runs, indent=1, default=str))
    found = differences(base, now)
    counts = {k: len(v) for k, v in now.items()}
    print(f"{base_label} vs {now_label}: compared {counts}", flush=True)
    for line in found:
        print(line)
    print("no difference" if not found else f"{len(found)} differences")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
