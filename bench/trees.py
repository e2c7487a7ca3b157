"""Before/after on a shared machine: the service of several source trees (git worktrees of the
commits to compare), and optionally the bare server, in one run, taking turns window by window.

On a noisy machine a change of tens of microseconds per request is lost between two runs; here
every tree's service serves the same requests in the same minutes, so the load that other work
puts on the machine falls on all of them alike. Each service runs from its own tree (its working
directory and PYTHONPATH), pinned to core 1 with this client on core 0, with bench/floor.py's
models, configuration and measurement (server CPU per request from /proc, p50, throughput).
Prints medians over rounds (with the range) and the paired ratios to the first tree.

    git worktree add /tmp/before <commit>
    .venv/bin/python -m bench.trees --trees before=/tmp/before,after=. [--bare] [--models tiny]
        [--apis kserve,v1] [--rounds 4] [--duration 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import grpc

from bench.floor import CONFIG, MODELS, measure, open_calls, request_for
from bench.lib.trees import pythonpath, source_trees
from bench.processes import ROOT, SERVICE_READY, ServerProcess, service_command
from models.demo_models import write_model

SERVER_CORE, CLIENT_CORE = 1, 0
# (concurrency, metric, label) of each printed line.
LINES = (
    (16, "server_cpu_us_per_request", "CPU us/req c=16"),
    (16, "throughput", "req/s c=16"),
    (1, "p50_us", "p50 us c=1"),
)


def tree_service(label: str, tree: Path, repository: Path, workdir: Path, prefix: list[str]) -> ServerProcess:
    """The service of `tree`, started from there (ServerProcess.spawn copies os.environ)."""
    os.environ["PYTHONPATH"] = f"{pythonpath(tree)}{os.pathsep}{tree}"
    argv = [*service_command(repository, prefix), "--metrics-listen", "127.0.0.1:0", "--grace-s", "1"]
    old = tree / "proto" / "python" / "modelyard"
    if old.is_dir() and not (old / "service").exists():
        argv[argv.index("modelyard.service")] = "service"  # a tree from before the namespace move
    server = ServerProcess(label, argv, workdir, SERVICE_READY, cwd=tree)
    server.spawn()
    return server


async def run(args: argparse.Namespace) -> int:
    pin = (os.cpu_count() or 1) >= 2
    prefix = ["taskset", "-c", str(SERVER_CORE)] if pin else []
    if pin:
        os.sched_setaffinity(0, {CLIENT_CORE})
    rows: list[tuple[str, str, int, str, dict[str, float]]] = []
    own_path = os.environ.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory(prefix="bench-trees-") as tmp:
        workdir = Path(tmp)
        repository = workdir / "models"
        for name in args.models:
            write_model(repository, name, 1, MODELS[name][0](), CONFIG)
        servers: list[ServerProcess] = []
        channels: list[grpc.aio.Channel] = []
        try:
            for label, tree in args.trees:
                servers.append(tree_service(label, tree, repository, workdir, prefix))
            os.environ["PYTHONPATH"] = own_path
            if args.bare:
                bare_argv = [*prefix, sys.executable, str(ROOT / "bench" / "bare_server.py"), str(repository)]
                bare = ServerProcess("bare", bare_argv, workdir, re.compile(r"^(\d+)$", re.M))
                bare.spawn()
                servers.append(bare)
            await asyncio.gather(*(server.wait_ready() for server in servers))
            calls = open_calls(servers, channels)
            for round_ in range(args.rounds):
                for model in args.models:
                    for api in args.apis:
                        request = request_for(api, model, MODELS[model][1])
                        for concurrency in (16, 1):
                            turn = round_ % len(servers)  # who goes first, in turn
                            for server in servers[turn:] + servers[:turn]:
                                call = calls[(server.name, api)]
                                result = await measure(server, call, request, concurrency, args)
                                rows.append((model, api, concurrency, server.name, result))
        finally:
            os.environ["PYTHONPATH"] = own_path
            for channel in channels:
                await channel.close(None)
            for server in servers:
                server.stop()
    print_table(rows, [server.name for server in servers], args)
    return 0


def print_table(
    rows: list[tuple[str, str, int, str, dict[str, float]]], names: list[str], args: argparse.Namespace
) -> None:
    first = names[0]
    header = "".join(f"{name:>24}" for name in names) + "".join(f"{n + '/' + first:>16}" for n in names[1:])
    print(f"{'':<28}{header}")
    for model in args.models:
        for api in args.apis:
            for concurrency, metric, label in LINES:
                values = {
                    name: [r[4][metric] for r in rows if r[:4] == (model, api, concurrency, name)]
                    for name in names
                }
                cells = "".join(
                    f"{statistics.median(v):.1f} [{min(v):.0f}-{max(v):.0f}]".rjust(24)
                    for v in values.values()
                )
                paired = {
                    n: [a / b for a, b in zip(values[n], values[first], strict=True)] for n in names[1:]
                }
                ratios = "".join(f"{statistics.median(v):>16.3f}" for v in paired.values())
                print(f"{model + ' ' + api + ' ' + label:<28}{cells}{ratios}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    def names(text: str) -> list[str]:
        return [part for part in text.split(",") if part]

    parser = argparse.ArgumentParser(
        prog="bench.trees", description=__doc__.split("\n")[0] if __doc__ else None
    )
    parser.add_argument(
        "--trees", type=source_trees, required=True, help="LABEL=PATH,... (the first is the reference)"
    )
    parser.add_argument("--bare", action="store_true", help="the bare server (bench/bare_server.py) too")
    parser.add_argument("--models", type=names, default=["tiny"])
    parser.add_argument("--apis", type=names, default=["kserve", "v1"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=float, default=0.3)
    parser.add_argument("--duration", type=float, default=2.0)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {', '.join(unknown)} (known: {', '.join(MODELS)})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
