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

With --cache-sim, callgrind also simulates a small cache (16 KiB L1s, a 512 KiB last level: what
one core keeps of a shared VM's caches when its neighbours are busy) and prints the last-level
misses per request beside the instructions: the figure for a path's footprint, which
instructions miss (the service ran fewer instructions than the bare server and took more CPU).

    .venv/bin/python -m bench.instructions --trees base=/work/wt/base,now=. [--bare] [--bare-served-only]
        [--models tiny] [--apis kserve,v1] [--requests 320] [--keep DIR] [--cache-sim] [--executor]

With --executor every run of the service goes to its executor (none inline, as on a machine where
a model's runs are longer than the inline limit): the hand-off's cost, per request.

With --sidecar, the same for the sidecar hop (bench/sidecar.py's set-up: two versions of tiny, a
10% canary, a tenant limit on every call, a fresh x-user-id per call): one service runs natively,
each tree's `python -m modelyard.sidecar` in front of it runs under callgrind (and, with
--tracing SAMPLER[:ARG], a second one of each tree with tracing on, exporting to a receiver in
this process that drops what it gets), and with --bare bench/bare_proxy.py (the reference, from
this tree). Threads are counted apart (--separate-threads): the main thread's share and the rest
(gRPC's poller, a span exporter) are printed beside the total. The breakers' latency check, timed
work, runs once in a long while here (INSTRUCTIONS_ROUTES): at valgrind's pace it would weigh
~50x per call what it does natively.

    .venv/bin/python -m bench.instructions --sidecar --trees base=/work/wt/base,now=. --bare
        [--tracing parentbased_traceidratio:0.01] [--requests 320] [--keep DIR]
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

from bench.floor import CONFIG, MODELS, open_calls, request_for, send_all
from bench.lib.trees import pythonpath, source_trees
from bench.processes import ROOT, SERVICE_READY, ServerProcess
from models.demo_models import write_model

CONCURRENCY = 16
LL_MISSES = ("ILmr", "DLmr", "DLmw")
# --sidecar: the breakers' latency check is timed work (every 0.1 s by default); under valgrind
# the sidecar serves ~30 calls a second, not ~1,500, so counted per call it weighs ~50x what it
# does natively and swings from run to run (two traced runs of one tree differed by 46k a call).
# Checked once in a long while here, two runs of one tree agree to tens of instructions.
INSTRUCTIONS_ROUTES = "breaker: {latency_check_s: 1000}\n"
# --cache-sim: a small simulated cache, so that a larger per-request footprint shows as misses.
CACHE_SIM = ["--cache-sim=yes", "--I1=16384,4,64", "--D1=16384,4,64", "--LL=524288,8,64"]
BARE_SERVED_ONLY = "bare_served"  # bench/bare_server.py --served-only: no registered method
WARMUP_REQUESTS = 320
# The service as it runs natively, under valgrind's slowdown: inline runs stay inline (with
# --executor, $INLINE_LIMIT_S = 0: every run goes to the executor).
INLINE_LIMIT = "INLINE_LIMIT_S"
LAUNCHER = (
    "import os, runpy, sys\n"
    "import modelyard.service.runtime.session as session\n"
    "import modelyard.service.runtime.instances as instances\n"
    f"limit = float(os.environ.get('{INLINE_LIMIT}', '1.0'))\n"
    "session.ONE_CORE_INLINE_RUN_LIMIT_S = session.INLINE_RUN_LIMIT_S = limit\n"
    "instances.INLINE_WATCHDOG_S = 1e9\n"
    "sys.argv[0] = 'modelyard.service'\n"
    "runpy.run_module('modelyard.service', run_name='__main__', alter_sys=True)\n"
)


def server(
    label: str, tree: Path | None, repository: Path, workdir: Path, out: Path, cache_sim: bool = False
) -> ServerProcess:
    """The tree's service (None: the bare server) under callgrind, counting off, pinned to core 1."""
    valgrind = ["taskset", "-c", "1", "valgrind", "--tool=callgrind", "--instr-atstart=no"]
    valgrind.append(f"--callgrind-out-file={out}")
    valgrind += CACHE_SIM if cache_sim else []
    if tree is None:
        argv = [*valgrind, sys.executable, str(ROOT / "bench" / "bare_server.py"), str(repository)]
        if label == BARE_SERVED_ONLY:
            argv.append("--served-only")
        return ServerProcess(label, argv, workdir, re.compile(r"^(\d+)$", re.M))
    os.environ["PYTHONPATH"] = pythonpath(tree)
    argv = [*valgrind, sys.executable, "-c", LAUNCHER, "--repository", str(repository)]
    # The metrics listener on a free port too: the default one may be another service's.
    argv += ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--grace-s", "1"]
    return ServerProcess(label, argv, workdir, SERVICE_READY, cwd=tree)


def callgrind(command: str, pid: int) -> None:
    subprocess.run(["callgrind_control", command, str(pid)], check=True, capture_output=True)


def kept(out: Path, keep: Path) -> None:
    """Copy one run's dumps to `keep`, for callgrind_annotate (which C functions ran them)."""
    keep.mkdir(parents=True, exist_ok=True)
    for path in glob.glob(f"{out}*"):
        shutil.copy(path, keep / Path(path).name)


def events(out: Path) -> dict[str, int]:
    """The events counted in callgrind's dumps of one run (Ir: instructions; with the cache
    simulated also ILmr, DLmr, DLmw: last-level misses of instruction fetches, reads, writes)."""
    totals: dict[str, int] = {}
    for path in glob.glob(f"{out}*"):
        names: list[str] = []
        with open(path) as f:
            for line in f:
                if line.startswith("events:"):
                    names = line.split()[1:]
                elif line.startswith("totals:"):  # all counts zero: one 0
                    for name, value in zip(names, line.split()[1:], strict=False):
                        totals[name] = totals.get(name, 0) + int(value)
    return totals


async def measure(
    label: str,
    tree: Path | None,
    model: str,
    api: str,
    requests: int,
    workdir: Path,
    keep: Path | None = None,
    cache_sim: bool = False,
) -> dict[str, float]:
    """Callgrind's events per request (Ir: instructions; see `events`)."""
    repository = workdir / "models"
    out = workdir / f"{label}-{model}-{api}.callgrind"
    process = server(label, tree, repository, workdir, out, cache_sim)
    process.spawn()
    channels: list[grpc.aio.Channel] = []
    try:
        await process.wait_ready(900.0)
        call: Any = open_calls([process], channels)[(label, api)]  # called with a timeout
        request = request_for(api, model, MODELS[model][1])

        await send_all(call, request, WARMUP_REQUESTS, CONCURRENCY, 600)
        callgrind("--instr=on", process.pid)
        await send_all(call, request, requests, CONCURRENCY, 600)
        callgrind("--instr=off", process.pid)
        callgrind("--dump", process.pid)
    finally:
        for channel in channels:
            await channel.close(None)
        process.stop()
    if keep is not None:
        kept(out, keep)
    counted = requests // CONCURRENCY * CONCURRENCY
    return {name: value / counted for name, value in events(out).items()}


async def run(args: argparse.Namespace) -> int:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind (callgrind) is not installed", file=sys.stderr)
        return 1
    targets: list[tuple[str, Path | None]] = [*args.trees, *([("bare", None)] if args.bare else [])]
    if args.bare_served_only:
        targets.append((BARE_SERVED_ONLY, None))
    own_path = os.environ.get("PYTHONPATH", "")
    if args.executor:
        os.environ[INLINE_LIMIT] = "0"
    results: dict[tuple[str, str, str], float] = {}
    misses: dict[tuple[str, str, str], float] = {}  # --cache-sim: last-level misses per request
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
        workdir = Path(tmp)
        for model in args.models:
            write_model(workdir / "models", model, 1, MODELS[model][0](), CONFIG)
        try:
            for model in args.models:
                for api in args.apis:
                    for label, tree in targets:
                        os.environ["PYTHONPATH"] = own_path  # a tree's service sets its own
                        counted = await measure(
                            label, tree, model, api, args.requests, workdir, args.keep, args.cache_sim
                        )
                        per_request = results[(model, api, label)] = counted["Ir"]
                        line = f"{model} {api} {label}: {per_request:,.0f} instructions/request"
                        if args.cache_sim:
                            misses[(model, api, label)] = sum(counted[e] for e in LL_MISSES)
                            line += (
                                " (last-level misses: "
                                + ", ".join(f"{e} {counted[e]:,.0f}" for e in LL_MISSES)
                                + ")"
                            )
                        print(line, file=sys.stderr)
        finally:
            os.environ["PYTHONPATH"] = own_path
    first = targets[0][0]
    print(f"\n{'':<13}" + "".join(f"{label:>14}" for label, _ in targets) + f"   (ratios to {first})")
    for model in args.models:
        for api in args.apis:
            print_row(f"{model} {api}", [results[(model, api, label)] for label, _ in targets])
    if misses:
        print("\nlast-level misses per request (simulated 512 KiB cache: instruction fetches, reads, writes)")
        for model in args.models:
            for api in args.apis:
                print_row(f"{model} {api}", [misses[(model, api, label)] for label, _ in targets])
    return 0


def print_row(name: str, row: list[float]) -> None:
    """One point's figures per target, then each one's ratio to the first."""
    ratios = "  ".join(f"{value / row[0]:.3f}" for value in row[1:])
    print(f"{name:<13}" + "".join(f"{value:>14,.0f}" for value in row) + f"   {ratios}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    def names(text: str) -> list[str]:
        return [part for part in text.split(",") if part]

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--trees", type=source_trees, required=True, help="label=path,... (git worktrees)")
    parser.add_argument("--bare", action="store_true", help="the bare server (bench/bare_server.py) too")
    parser.add_argument(
        "--bare-served-only",
        action="store_true",
        help="also the bare server with --served-only (no grpc.aio registered method, as the service)",
    )
    parser.add_argument("--models", type=names, default=["tiny"])
    parser.add_argument("--apis", type=names, default=["kserve", "v1"])
    parser.add_argument("--requests", type=int, default=320, help="counted requests per point")
    parser.add_argument(
        "--cache-sim",
        action="store_true",
        help="also simulate a small cache and print last-level misses per request (the service)",
    )
    parser.add_argument(
        "--executor",
        action="store_true",
        help="the service's runs on its executor (none inline): the hand-off's cost per request",
    )
    parser.add_argument("--sidecar", action="store_true", help="the sidecar hop instead of the service")
    parser.add_argument(
        "--tracing", default="", metavar="SAMPLER[:ARG]", help="--sidecar: also each tree's sidecar traced so"
    )
    parser.add_argument(
        "--keep", type=Path, default=None, help="keep callgrind's dumps here (for callgrind_annotate)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)  # --sidecar's callgrind writes its dumps straight there
    return asyncio.run(run_sidecar(args) if args.sidecar else run(args))


# --- the sidecar hop (--sidecar) ---------------------------------------------------------------


def sidecar_server(
    label: str, tree: Path | None, upstream: str, routes: Path, env: Sequence[str], workdir: Path, out: Path
) -> ServerProcess:
    """The tree's sidecar (None: the bare proxy of this tree) under callgrind, counting off,
    each thread counted apart, pinned to core 1; `env`: NAME=VALUE set for it (tracing)."""
    from bench.sidecar import BARE_READY, SIDECAR_READY

    valgrind = ["env", *env, "taskset", "-c", "1", "valgrind", "--tool=callgrind", "--instr-atstart=no"]
    valgrind += ["--separate-threads=yes", f"--callgrind-out-file={out}"]
    if tree is None:
        argv = [*valgrind, sys.executable, "-m", "bench.bare_proxy", "--upstream", upstream]
        return ServerProcess(label, argv, workdir, BARE_READY)
    argv = [*valgrind, sys.executable, "-m", "modelyard.sidecar", "--listen", "127.0.0.1:0"]
    argv += ["--upstream", upstream, "--admin-listen", "", "--config", str(routes), "--grace-s", "1"]
    return ServerProcess(label, argv, workdir, SIDECAR_READY, cwd=tree)


def thread_instructions(out: Path) -> list[int]:
    """Instructions per thread of one run (callgrind's per-thread dumps), most first."""
    totals = []
    for path in glob.glob(f"{out}*"):
        with open(path) as f:
            totals.append(sum(int(line.split()[1]) for line in f if line.startswith("totals:")))
    return sorted(totals, reverse=True)


async def measure_sidecar(
    label: str,
    tree: Path | None,
    upstream: str,
    routes: Path,
    env: Sequence[str],
    requests: int,
    workdir: Path,
    keep: Path | None = None,
) -> list[float]:
    """Instructions per request of one proxy under saturating load: its threads', most first."""
    from bench.sidecar import TENANT_MD, infer_request, wait_sidecar_ready
    from modelyard.kserve.v2 import grpc_service_pb2_grpc as kserve_grpc

    out = (keep or workdir) / f"{label}.callgrind"
    own_path = os.environ.get("PYTHONPATH", "")
    if tree is not None:
        os.environ["PYTHONPATH"] = pythonpath(tree)
    try:
        process = sidecar_server(label, tree, upstream, routes, env, workdir, out)
        process.spawn()
    finally:
        os.environ["PYTHONPATH"] = own_path
    try:
        await process.wait_ready(900.0)
        address = f"127.0.0.1:{process.port}"
        if tree is not None:
            await wait_sidecar_ready(address)
        request = infer_request()
        async with grpc.aio.insecure_channel(address) as channel:
            call = kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer

            async def load(count: int, tag: str) -> None:
                async def client(n: int) -> None:
                    for i in range(count // CONCURRENCY):
                        await call(request, metadata=[("x-user-id", f"{tag}{n}-{i}"), TENANT_MD], timeout=600)

                await asyncio.gather(*(client(n) for n in range(CONCURRENCY)))

            await load(WARMUP_REQUESTS, "w")
            callgrind("--instr=on", process.pid)
            await load(requests, "u")
            callgrind("--instr=off", process.pid)
            callgrind("--dump", process.pid)
    finally:
        process.stop()
    counted = requests // CONCURRENCY * CONCURRENCY
    return [count / counted for count in thread_instructions(out)]


async def run_sidecar(args: argparse.Namespace) -> int:
    from bench.processes import running_service
    from bench.sidecar import ROUTES, build_repository, trace_receiver, tracing_env

    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind (callgrind) is not installed", file=sys.stderr)
        return 1
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
        workdir = Path(tmp)
        build_repository(workdir / "models")
        routes = workdir / "routes.yaml"
        routes.write_text(ROUTES + INSTRUCTIONS_ROUTES)
        receiver, port = await trace_receiver() if args.tracing else (None, 0)
        traced_env = tracing_env(args.tracing, port) if args.tracing else []
        targets: list[tuple[str, Path | None, list[str]]] = [(label, tree, []) for label, tree in args.trees]
        if args.tracing:
            targets += [(f"{label}_traced", tree, traced_env) for label, tree in args.trees]
        if args.bare:
            targets.append(("bare", None, []))
        try:
            async with running_service(workdir / "models", workdir) as service:
                upstream = f"127.0.0.1:{service.port}"
                for label, tree, env in targets:
                    threads = await measure_sidecar(
                        label, tree, upstream, routes, env, args.requests, workdir, args.keep
                    )
                    results[label] = threads
                    print(f"{label}: {sum(threads):,.0f} instructions/request", file=sys.stderr)
        finally:
            if receiver is not None:
                await receiver.stop(None)
    reference = "bare" if args.bare else targets[0][0]
    print(f"\n{'':<14}{'total':>12}{'busiest':>12}{'others':>12}   x {reference}")
    for label, threads in results.items():
        total = sum(threads)
        ratio = total / sum(results[reference])
        print(f"{label:<14}{total:>12,.0f}{threads[0]:>12,.0f}{total - threads[0]:>12,.0f}   {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
