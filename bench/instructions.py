"""Instructions per request under saturating load, counted by valgrind's callgrind: a figure that
other work on the machine does not move, for before/after pairs on a shared machine where the
CPU time per request of bench.trees swings by 20-40% from round to round.

Each tree's service (and, with --bare, bench/bare_server.py) runs under callgrind with counting
off; 16 client coroutines keep it saturated; counting is switched on for `--requests` requests
of bench/floor.py's models and requests, then the server's instructions are divided by them.
Under valgrind a run is ~50x slower, so the service's run-time limits (which runs go inline on
the event loop, the inline-run watchdog) are lifted to keep the path the one it takes natively
for the tiny model; an MLP's runs would go to the executor, so --models is tiny by default.
Instructions are not time (cache misses under load make the same instructions ~3x dearer than
in a hot loop), but fewer instructions on the same path are less CPU.

    .venv/bin/python -m bench.instructions --trees base=/work/wt/base,now=. [--bare]
        [--models tiny] [--apis kserve,v1] [--requests 320] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from bench.floor import CONFIG, MODELS, open_calls, request_for
from bench.processes import ROOT, SERVICE_READY, ServerProcess
from models.demo_models import write_model

CONCURRENCY = 16
WARMUP_REQUESTS = 320
# The service as it runs natively, under valgrind's slowdown: inline runs stay inline.
LAUNCHER = (
    "import runpy, sys\n"
    "import modelyard.service.runtime.session as session\n"
    "import modelyard.service.runtime.instances as instances\n"
    "session.ONE_CORE_INLINE_RUN_LIMIT_S = session.INLINE_RUN_LIMIT_S = 1.0\n"
    "instances.INLINE_WATCHDOG_S = 1e9\n"
    "sys.argv[0] = 'modelyard.service'\n"
    "runpy.run_module('modelyard.service', run_name='__main__', alter_sys=True)\n"
)


def server(label: str, tree: Path | None, repository: Path, workdir: Path, out: Path) -> ServerProcess:
    """The tree's service (None: the bare server) under callgrind, counting off, pinned to core 1."""
    valgrind = ["taskset", "-c", "1", "valgrind", "--tool=callgrind", "--instr-atstart=no"]
    valgrind.append(f"--callgrind-out-file={out}")
    if tree is None:
        argv = [*valgrind, sys.executable, str(ROOT / "bench" / "bare_server.py"), str(repository)]
        return ServerProcess(label, argv, workdir, re.compile(r"^(\d+)$", re.M))
    os.environ["PYTHONPATH"] = str(tree / "proto" / "python")
    argv = [*valgrind, sys.executable, "-c", LAUNCHER, "--repository", str(repository)]
    argv += ["--listen", "127.0.0.1:0", "--grace-s", "1"]
    return ServerProcess(label, argv, workdir, SERVICE_READY, cwd=tree)


def callgrind(command: str, pid: int) -> None:
    subprocess.run(["callgrind_control", command, str(pid)], check=True, capture_output=True)


def kept(out: Path, keep: Path) -> None:
    """Copy one run's dumps to `keep`, for callgrind_annotate (which C functions ran them)."""
    keep.mkdir(parents=True, exist_ok=True)
    for path in glob.glob(f"{out}*"):
        shutil.copy(path, keep / Path(path).name)


def instructions(out: Path) -> int:
    """The instructions counted in callgrind's dumps of one run."""
    total = 0
    for path in glob.glob(f"{out}*"):
        with open(path) as f:
            total += sum(int(line.split()[1]) for line in f if line.startswith("totals:"))
    return total


async def measure(
    label: str,
    tree: Path | None,
    model: str,
    api: str,
    requests: int,
    workdir: Path,
    keep: Path | None = None,
) -> float:
    repository = workdir / "models"
    out = workdir / f"{label}-{model}-{api}.callgrind"
    process = server(label, tree, repository, workdir, out)
    process.spawn()
    channels: list[grpc.aio.Channel] = []
    try:
        await process.wait_ready(900.0)
        call: Any = open_calls([process], channels)[(label, api)]  # called with a timeout
        request = request_for(api, model, MODELS[model][1])

        async def load(count: int) -> None:
            async def client() -> None:
                for _ in range(count // CONCURRENCY):
                    await call(request, timeout=600)

            await asyncio.gather(*(client() for _ in range(CONCURRENCY)))

        await load(WARMUP_REQUESTS)
        callgrind("--instr=on", process.pid)
        await load(requests)
        callgrind("--instr=off", process.pid)
        callgrind("--dump", process.pid)
    finally:
        for channel in channels:
            await channel.close(None)
        process.stop()
    if keep is not None:
        kept(out, keep)
    return instructions(out) / (requests // CONCURRENCY * CONCURRENCY)


async def run(args: argparse.Namespace) -> int:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind (callgrind) is not installed", file=sys.stderr)
        return 1
    targets: list[tuple[str, Path | None]] = [*args.trees, *([("bare", None)] if args.bare else [])]
    own_path = os.environ.get("PYTHONPATH", "")
    results: dict[tuple[str, str, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
        workdir = Path(tmp)
        for model in args.models:
            write_model(workdir / "models", model, 1, MODELS[model][0](), CONFIG)
        try:
            for model in args.models:
                for api in args.apis:
                    for label, tree in targets:
                        os.environ["PYTHONPATH"] = own_path  # a tree's service sets its own
                        per_request = await measure(
                            label, tree, model, api, args.requests, workdir, args.keep
                        )
                        results[(model, api, label)] = per_request
                        print(
                            f"{model} {api} {label}: {per_request:,.0f} instructions/request", file=sys.stderr
                        )
        finally:
            os.environ["PYTHONPATH"] = own_path
    first = targets[0][0]
    print(f"\n{'':<13}" + "".join(f"{label:>14}" for label, _ in targets) + f"   (ratios to {first})")
    for model in args.models:
        for api in args.apis:
            row = [results[(model, api, label)] for label, _ in targets]
            ratios = "  ".join(f"{value / row[0]:.3f}" for value in row[1:])
            print(f"{model + ' ' + api:<13}" + "".join(f"{value:>14,.0f}" for value in row) + f"   {ratios}")
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    def names(text: str) -> list[str]:
        return [part for part in text.split(",") if part]

    def trees(text: str) -> list[tuple[str, Path]]:
        pairs = [part.split("=", 1) for part in names(text)]
        return [(label, Path(path).resolve()) for label, path in pairs]

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--trees", type=trees, required=True, help="label=path,... (git worktrees)")
    parser.add_argument("--bare", action="store_true", help="the bare server (bench/bare_server.py) too")
    parser.add_argument("--models", type=names, default=["tiny"])
    parser.add_argument("--apis", type=names, default=["kserve", "v1"])
    parser.add_argument("--requests", type=int, default=320, help="counted requests per point")
    parser.add_argument(
        "--keep", type=Path, default=None, help="copy callgrind's dumps here (for callgrind_annotate)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
