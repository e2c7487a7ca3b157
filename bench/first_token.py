"""The service's own share of a Generate's time to first token, per source tree, in one run:

    .venv/bin/python -m bench.first_token [--trees base=DIR,now=DIR] [--requests 200] [--rounds 2]

Each tree's service runs in a child process of its own (this file, with that tree's code first on
PYTHONPATH: the service in process, on loopback, the demo model), called by a client in the same
process one request at a time (codelm, 4 tokens). Two intervals per request: from the first token
delivered by the decode loop (Engine._after_prefill, on the event loop) to the first message's
write starting (inference_servicer.write), the work between the token and its message (in a
tree where the stream's headers wait for the first message, their write too); and the client's
TTFT. Trees take turns
round by round, so load from elsewhere falls on each alike; medians, p10 and p90 per tree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.lib.trees import pythonpath

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def __init__(self"
WARMUP = 10


async def serve_one(requests: int) -> dict[str, list[float]]:
    """Run the service in this process (the tree PYTHONPATH gives) and time `requests` calls."""
    import grpc

    from modelyard.inference.v1 import inference_service_pb2 as pb
    from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
    from modelyard.service.api import inference_servicer as servicer
    from modelyard.service.generation import engine
    from modelyard.service.server import build_service
    from modelyard.service.settings import Settings

    marks: dict[str, float] = {}
    after_prefill, write = engine.Engine._after_prefill, servicer.write

    def delivered(self: Any, sequence: Any, result: Any) -> None:
        marks.setdefault("token", time.perf_counter())
        after_prefill(self, sequence, result)

    async def written(context: Any, message: Any) -> None:
        marks.setdefault("write", time.perf_counter())
        await write(context, message)

    engine.Engine._after_prefill = delivered  # type: ignore[method-assign]
    servicer.write = written
    settings = Settings(repository=ROOT / "models" / "demo", listen="127.0.0.1:0", metrics_listen="")
    service = build_service(settings)
    await service.start()
    out: dict[str, list[float]] = {"token -> write": [], "client TTFT": []}
    try:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            for i in range(WARMUP + requests):
                marks.clear()
                start = time.perf_counter()
                first = 0.0
                async for _ in stub.Generate(
                    pb.GenerateRequest(model_name="codelm", prompt=PROMPT, max_tokens=4)
                ):
                    first = first or time.perf_counter()
                if i >= WARMUP:
                    out["token -> write"].append(marks["write"] - marks["token"])
                    out["client TTFT"].append(first - start)
    finally:
        await service.stop(grace_s=1.0)
    return out


def run_tree(tree: Path, requests: int) -> dict[str, list[float]]:
    env = dict(os.environ, PYTHONPATH=pythonpath(tree), PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run(
        [sys.executable, "-m", "bench.first_token", "--serve-one", str(requests)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    result: dict[str, list[float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trees", default="now=.", metavar="NAME=TREE,...")
    parser.add_argument("--requests", type=int, default=200, help="per tree and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve-one", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_one:
        print(json.dumps(asyncio.run(serve_one(args.serve_one))))
        return
    trees = [
        (name, Path(tree).resolve()) for name, _, tree in (t.partition("=") for t in args.trees.split(","))
    ]
    got: dict[str, dict[str, list[float]]] = {name: {} for name, _ in trees}
    for turn in range(args.rounds):
        for name, tree in trees if turn % 2 == 0 else trees[::-1]:
            for key, values in run_tree(tree, args.requests).items():
                got[name].setdefault(key, []).extend(values)
    print(f"Generate, codelm, 4 tokens, {args.requests} requests x {args.rounds} rounds per tree (us)")
    print(f"{'tree':<10}{'interval':<18}{'median':>9}{'p10':>9}{'p90':>9}")
    for name, intervals in got.items():
        for key, values in intervals.items():
            deciles = statistics.quantiles(values, n=10)
            print(
                f"{name:<10}{key:<18}{statistics.median(values) * 1e6:>9.0f}"
                f"{deciles[0] * 1e6:>9.0f}{deciles[-1] * 1e6:>9.0f}"
            )


if __name__ == "__main__":
    main()
