"""The sidecar's own Python per dyed call, without gRPC: a hot loop over its ModelInfer handler
called as grpc.aio calls it (the drain's wrapper included), with a fake upstream call that answers
at once. The set-up is bench/sidecar.py's (two versions of tiny, a 10% canary, tenant `bench`
with a limit far above the load, a fresh x-user-id per call); tracing follows the OTEL_*
environment as in the sidecar. Prints the microseconds per call of each round; under callgrind
(`--callgrind`) only the last round is counted, with the collector off, so that two trees'
counts are a steady before/after pair (two runs of one tree agree to a few hundred instructions
a call, far less than the changes it is run for; the breakers' latency check, which runs per unit
of time, is kept out of the count). To compare
trees, run this file for each (from one checkout, TREE on PYTHONPATH):

    PYTHONPATH=$(.venv/bin/python -m bench.lib.trees --pythonpath TREE) \\
        valgrind --tool=callgrind --instr-atstart=no \\
        --callgrind-out-file=OUT .venv/bin/python -m bench.sidecar_hot --callgrind [--calls 2000]
    callgrind_annotate OUT | grep TOTALS    # divided by --calls
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any, cast

from bench.sidecar import ROUTES, TENANT, infer_request

PATH = "/inference.GRPCInferenceService/ModelInfer"
RESPONSE = b"\x0a\x04tiny" + b"x" * 80


class FakeCall:
    """An upstream call that has answered: what forward.ask reads of grpc.aio's call."""

    def __await__(self) -> Generator[Any, None, bytes]:
        yield from ()  # a generator that yields nothing: awaiting it returns at once
        return RESPONSE

    async def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-served-version", "1"),)

    def done(self) -> bool:
        return True

    def cancel(self) -> bool:
        return False


class FakeContext:
    """What the sidecar's unary path asks of grpc.aio's servicer context."""

    def __init__(self, md: tuple[tuple[str, str], ...]) -> None:
        self._md = md
        self.trailing: Any = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._md

    def time_remaining(self) -> float:
        return 10.0

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def set_trailing_metadata(self, md: Any) -> None:
        self.trailing = md

    async def send_initial_metadata(self, md: Any) -> None:
        return None

    def add_done_callback(self, callback: Any) -> None:
        return None

    async def abort(self, code: Any, details: str = "", md: Any = ()) -> None:
        raise RuntimeError(f"the sidecar refused the call: {code} {details} {md}")


def callgrind(switch: str) -> None:
    subprocess.run(["callgrind_control", "-i", switch, str(os.getpid())], check=True, capture_output=True)


async def run(args: argparse.Namespace) -> list[float]:
    from modelyard.sidecar.server import build_sidecar
    from modelyard.sidecar.settings import Settings

    routes = Path(tempfile.mkdtemp()) / "routes.yaml"
    # The breakers' latency check runs per unit of time (at most every latency_check_s), not per
    # call: a loop slowed by a busy machine (or by callgrind) would count more of it per call.
    routes.write_text(ROUTES + "breaker: {latency_check_s: 1000}\n")
    settings = Settings(listen="127.0.0.1:0", upstream=("127.0.0.1:1",), admin_listen="", config=str(routes))
    sidecar = build_sidecar(settings)
    await sidecar.start()
    try:
        upstream = sidecar.upstreams.all[0]
        upstream.served = {"tiny": frozenset({"1", "2"})}  # as WatchModels would tell
        upstream.watched = upstream.serving = True
        sidecar.upstreams_changed()
        await asyncio.sleep(0.2)  # the breakers follow the change
        upstream.method = lambda path, kind: lambda request, metadata=None, timeout=None: FakeCall()  # type: ignore[method-assign]
        request = infer_request().SerializeToString()
        # As grpc.aio finds and calls it (the drain's wrapper outermost); typed loosely: fakes.
        handler: Any = sidecar.proxy.service(cast(Any, _Details(PATH))).unary_unary
        per_call = []
        for r in range(args.rounds):
            contexts = [
                FakeContext((("x-user-id", f"u{r}-{i}"), ("x-tenant-id", TENANT))) for i in range(args.calls)
            ]
            counted = args.callgrind and r == args.rounds - 1
            if counted:
                gc.collect()
                gc.disable()
                callgrind("on")
            started = time.perf_counter()
            for context in contexts:
                if await handler(request, context) != RESPONSE:
                    raise SystemExit("the handler did not answer with the upstream's response")
            took = time.perf_counter() - started
            if counted:
                callgrind("off")
                gc.enable()
            per_call.append(took / args.calls * 1e6)
        return per_call
    finally:
        await sidecar.stop(grace_s=0.1)


class _Details:
    def __init__(self, method: str) -> None:
        self.method = method
        # None: each call's handler reads its FakeContext's metadata (request_metadata's fallback).
        self.invocation_metadata = None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sidecar_hot", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument(
        "--callgrind", action="store_true", help="count the last round only (under callgrind)"
    )
    args = parser.parse_args(argv)
    per_call = asyncio.run(run(args))
    print("us per call, by round:", " ".join(f"{us:.1f}" for us in per_call), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
