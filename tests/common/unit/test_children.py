"""modelyard.process.children on real (tiny) child processes: stopped for sure, ready lines found,
and a child told to die with its parent does."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable

from modelyard.process import children
from tests.support import eventually

PY = sys.executable
# A child that ignores SIGTERM, so only SIGKILL ends it; it says so first (it is ready then).
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] != "Z"


def _gone(pid: int) -> Callable[[], bool]:
    return lambda: not _alive(pid)


def test_stop_signals_and_a_child_that_ignores_it_is_killed_after_the_grace_period() -> None:
    polite = children.popen([PY, "-c", "import time; time.sleep(60)"])
    assert children.stop(polite, grace_s=10) is True
    assert polite.returncode == -signal.SIGTERM
    stubborn = children.popen([PY, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout is not None and stubborn.stdout.readline() == "ready\n"
    assert children.stop(stubborn, grace_s=0.2) is False
    assert stubborn.returncode == -signal.SIGKILL
    assert children.stop(stubborn) is True  # already gone: nothing is signalled


def test_follow_finds_the_ready_line_and_ends_when_the_child_exits_without_one() -> None:
    script = (
        "import sys; print('starting', file=sys.stderr); print('serving on 127.0.0.1:7', file=sys.stderr)"
    )
    seen: list[str] = []
    proc = children.popen([PY, "-c", script], stderr=subprocess.PIPE, text=True)
    lines = children.ReadyLine(re.compile(r"serving on (\S+)"), seen.append)
    assert proc.stderr is not None
    assert children.follow(proc.stderr, lines).wait(30)
    assert lines.match is not None and lines.match.group(1) == "127.0.0.1:7"
    proc.wait(30)
    assert seen[0] == "starting"
    silent = children.popen([PY, "-c", "print('no address')"], stdout=subprocess.PIPE, text=True)
    nothing = children.ReadyLine(re.compile("serving"))
    assert silent.stdout is not None
    assert children.follow(silent.stdout, nothing).wait(30) and nothing.match is None
    silent.wait(30)


async def test_async_child_ready_then_stopped_for_sure() -> None:
    proc = await children.create([PY, "-c", STUBBORN], stdout=asyncio.subprocess.PIPE, own_session=True)
    assert os.getsid(proc.pid) == proc.pid  # its own session
    ready = asyncio.Event()
    assert proc.stdout is not None
    pump = asyncio.ensure_future(
        children.follow_async(proc.stdout, children.ReadyLine(re.compile("ready")), ready)
    )
    assert await children.wait_ready(proc, ready, 30)
    assert await children.stop_async(proc, grace_s=0.2) is False
    assert proc.returncode == -signal.SIGKILL
    await pump
    exits = await children.create([PY, "-c", "pass"])
    assert not await children.wait_ready(exits, asyncio.Event(), 30)  # it exited, never ready
    assert await children.stop_async(exits) is True


async def test_a_child_started_with_its_parent_dies_with_it() -> None:
    # The middle process starts a grandchild that dies with it, prints its pid, then waits.
    for with_parent, dies in ((True, True), (False, False)):
        middle_script = (
            "import sys, time; from modelyard.process import children; "
            "p = children.popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
            f"with_parent={with_parent}); "
            "print(p.pid, flush=True); time.sleep(60)"
        )
        middle = children.popen([PY, "-c", middle_script], stdout=subprocess.PIPE, text=True)
        assert middle.stdout is not None
        grandchild = int(middle.stdout.readline())
        try:
            assert _alive(grandchild)
            middle.kill()
            middle.wait()
            if dies:
                await eventually(_gone(grandchild), "the grandchild to die with its parent")
            else:  # the check can fail: without the signal the grandchild lives on
                await asyncio.sleep(0.3)
                assert _alive(grandchild)
        finally:
            if _alive(grandchild):
                os.kill(grandchild, signal.SIGKILL)


def test_die_with_parent_signals_at_once_when_the_parent_is_already_gone() -> None:
    # The parent pid it is told about is not its parent's: it is gone, so the signal comes now.
    told = "import os; from modelyard.process import children; children.die_with_parent(parent=os.getppid()"
    script = told + " + 1); print('survived')"
    done = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == -signal.SIGTERM and "survived" not in done.stdout
    script = told + "); print('survived')"
    done = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "survived" in done.stdout


async def test_children_that_die_with_their_parent_start_beside_busy_grpc_threads() -> None:
    # A child forked to run Python before its exec (a preexec_fn) can crash there while this
    # process's gRPC threads are busy (grpc/grpc#43055: 8 of 40 in the benchmarks). Forty children
    # started beside a loaded in-process server must all run.
    import grpc

    async def echo(request: bytes, context: object) -> bytes:
        return request

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(echo)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("e.E", {"M": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    busy = True
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/e.E/M", None, None)

        async def load() -> None:
            while busy:
                await call(b"x")

        loads = [asyncio.ensure_future(load()) for _ in range(8)]

        def spawn() -> int:
            child = children.popen(["true"], own_session=True, with_parent=True)
            return child.wait(30)

        try:
            codes = [await asyncio.to_thread(spawn) for _ in range(40)]
        finally:
            busy = False
            await asyncio.gather(*loads, return_exceptions=True)
    await server.stop(None)
    assert codes == [0] * 40, codes
