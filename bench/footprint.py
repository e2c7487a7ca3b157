"""The request path's footprint: the distinct Python functions (and their bytecode) one request
enters on the server's event loop, for the service of each tree and the bare server.

Instructions per request (bench/instructions.py) count work; the footprint counts the code and
objects that work touches, which is what a shared VM's caches make dear: the service ran fewer
instructions than the bare server and missed the cache more often. Each server runs in a child
with a `sys.setprofile` hook on its main thread (the event loop's), switched on by SIGUSR1 after a
warm-up and off by SIGUSR2, which writes what it saw; 16 client coroutines keep it saturated with
bench/floor.py's models and requests. Every request walks the same path, so the distinct functions
of the counted window are one request's; calls are per request. "own" is the server's own code
(modelyard's for the service, bench/bare_server.py for the bare server), "shared" the rest
(asyncio, grpc.aio, the standard library, numpy).

    .venv/bin/python -m bench.footprint --trees base=/work/wt/base,now=. [--bare] [--models tiny]
        [--apis kserve,v1] [--requests 320] [--list]

`--list` prints each server's own functions, with their calls per request and bytecode size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from bench.floor import CONFIG, MODELS, open_calls, request_for, send_all
from bench.lib.trees import pythonpath, source_trees
from bench.processes import ROOT, SERVICE_READY, ServerProcess
from models.demo_models import write_model

CONCURRENCY = 16
WARMUP_REQUESTS = 320
BARE_READY = re.compile(r"^(\d+)$", re.M)  # the bare server prints its port
# The child's hook: on SIGUSR1 count every Python function entered on the main thread (code object
# -> calls), on SIGUSR2 stop and write them as JSON to $FOOTPRINT_OUT. Then the server itself.
LAUNCHER = """\
import json, os, runpy, signal, sys
seen = {}
def hook(frame, event, arg):
    if event == "call":
        code = frame.f_code
        seen[code] = seen.get(code, 0) + 1
def start(*_):
    seen.clear()
    sys.setprofile(hook)
def stop(*_):
    sys.setprofile(None)
    rows = [[c.co_filename, c.co_qualname, c.co_firstlineno, len(c.co_code), n] for c, n in seen.items()]
    with open(os.environ["FOOTPRINT_OUT"] + ".tmp", "w") as f:
        json.dump(rows, f)
    os.replace(os.environ["FOOTPRINT_OUT"] + ".tmp", os.environ["FOOTPRINT_OUT"])
signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, stop)
target = sys.argv.pop(1)
if target.endswith(".py"):
    sys.argv[0] = target
    runpy.run_path(target, run_name="__main__")
else:
    sys.argv[0] = target
    runpy.run_module(target, run_name="__main__", alter_sys=True)
"""


def server(label: str, tree: Path | None, repository: Path, workdir: Path) -> ServerProcess:
    """The tree's service (None: the bare server) with the hook, pinned to core 1."""
    prefix = ["taskset", "-c", "1", sys.executable, "-c", LAUNCHER]
    if tree is None:
        argv = [*prefix, str(ROOT / "bench" / "bare_server.py"), str(repository)]
        return ServerProcess(label, argv, workdir, BARE_READY)
    os.environ["PYTHONPATH"] = pythonpath(tree)
    argv = [*prefix, "modelyard.service", "--repository", str(repository)]
    argv += ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--grace-s", "1"]
    return ServerProcess(label, argv, workdir, SERVICE_READY, cwd=tree)


async def measure(
    label: str, tree: Path | None, model: str, api: str, requests: int, workdir: Path
) -> list[list[Any]]:
    """[file, function, first line, bytecode bytes, calls] of each function the counted requests
    entered on the server's main thread."""
    out = workdir / f"{label}-{model}-{api}.json"
    os.environ["FOOTPRINT_OUT"] = str(out)
    process = server(label, tree, workdir / "models", workdir)
    process.spawn()
    channels: list[grpc.aio.Channel] = []
    try:
        await process.wait_ready()
        call: Any = open_calls([process], channels)[(label, api)]
        request = request_for(api, model, MODELS[model][1])

        await send_all(call, request, WARMUP_REQUESTS, CONCURRENCY, 60)
        os.kill(process.pid, signal.SIGUSR1)
        await asyncio.sleep(0.2)  # the signal's handler runs between two of the loop's bytecodes
        await send_all(call, request, requests, CONCURRENCY, 60)
        os.kill(process.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 30
        while not out.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label} wrote no footprint:\n{process.log_tail()}")
            await asyncio.sleep(0.05)
    finally:
        for channel in channels:
            await channel.close(None)
        process.stop()
    rows: list[list[Any]] = json.loads(out.read_text())
    return rows


def own(path: str, tree: Path | None) -> bool:
    """The server's own code: modelyard's (the service), bench/bare_server.py (the bare server)."""
    if tree is None:
        return path.endswith("bare_server.py")
    return "/modelyard/" in path or path.startswith(str(tree))


def summary(rows: list[list[Any]], tree: Path | None, requests: int) -> dict[str, float]:
    """Distinct functions, their bytecode (KB) and calls per request: all, and the server's own."""
    mine = [row for row in rows if own(row[0], tree)]
    return {
        "functions": len(rows),
        "bytecode_kb": sum(row[3] for row in rows) / 1024,
        "calls": sum(row[4] for row in rows) / requests,
        "own_functions": len(mine),
        "own_bytecode_kb": sum(row[3] for row in mine) / 1024,
        "own_calls": sum(row[4] for row in mine) / requests,
    }


def figures(s: dict[str, float], part: str) -> str:
    """Functions, KB of bytecode and calls of a summary (`part` "own_": the server's own)."""
    functions, kb, calls = (s[part + key] for key in ("functions", "bytecode_kb", "calls"))
    return f"{functions:>{10 - len(part)},.0f}{kb:>7.1f}{calls:>8.1f}"


def print_own(rows: list[list[Any]], tree: Path | None, requests: int) -> None:
    """The server's own functions: calls per request, bytecode bytes, where."""
    for path, name, line, size, calls in sorted(rows, key=lambda r: (r[0], r[2])):
        if own(path, tree):
            where = path.rsplit("/modelyard/", 1)[-1]
            print(f"    {calls / requests:6.2f} {size:6,d} B  {where}:{line} {name}")


async def run(args: argparse.Namespace) -> int:
    targets: list[tuple[str, Path | None]] = [*args.trees, *([("bare", None)] if args.bare else [])]
    own_path = os.environ.get("PYTHONPATH", "")
    counted = args.requests // CONCURRENCY * CONCURRENCY
    with tempfile.TemporaryDirectory(prefix="bench-footprint-") as tmp:
        workdir = Path(tmp)
        for model in args.models:
            write_model(workdir / "models", model, 1, MODELS[model][0](), CONFIG)
        try:
            for model in args.models:
                for api in args.apis:
                    print(f"\n{model} {api}: per request (the server's main thread)")
                    print(f"{'':<8}{'functions':>10}{'KB':>7}{'calls':>8}   {'own':>5}{'KB':>7}{'calls':>8}")
                    for label, tree in targets:
                        os.environ["PYTHONPATH"] = own_path  # a tree's service sets its own
                        rows = await measure(label, tree, model, api, args.requests, workdir)
                        s = summary(rows, tree, counted)
                        print(f"{label:<8}{figures(s, '')}   {figures(s, 'own_')}")
                        if args.list:
                            print_own(rows, tree, counted)
        finally:
            os.environ["PYTHONPATH"] = own_path
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    def names(text: str) -> list[str]:
        return [part for part in text.split(",") if part]

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--trees", type=source_trees, default=[], help="label=path,... (git worktrees)")
    parser.add_argument("--bare", action="store_true", help="the bare server (bench/bare_server.py) too")
    parser.add_argument("--models", type=names, default=["tiny"])
    parser.add_argument("--apis", type=names, default=["kserve", "v1"])
    parser.add_argument("--requests", type=int, default=320, help="counted requests per point")
    parser.add_argument("--list", action="store_true", help="each server's own functions, calls per request")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
