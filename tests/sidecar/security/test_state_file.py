"""The sidecar's --state-file against what can go wrong with a file: anything that is not the
sidecar's state (truncated, empty, not JSON, the wrong shape, not UTF-8, a number that is not
finite, a name that breaks the name rule, a folder, a symlink, a FIFO) stops the start with one
line naming the file and what is wrong (exit 2, no traceback, no hang); a change that cannot be
written is answered with an error, not 200; an acknowledged change is on disk, so a SIGKILL loses
none; a crash's temporary files are removed at the next start. Real processes, as an operator runs
them, where the exit is the point."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.sidecar_support import SidecarProcess, running_sidecar
from tests.support import REPO_ROOT

GOOD: dict[str, Any] = {
    "format": 1,
    "routes": {
        "overrides": {
            "scaler": {"canary_weight": 10.0, "stable": "1", "canary": "2", "at": 5.0, "source": "admin"}
        },
        "file": {},
    },
    "rollouts": {},
}
ROLLOUT: dict[str, Any] = {"spec": {}, "started": 1.0, "state": "running", "step": 0, "step_started": 1.0}


def text(value: str) -> Callable[[Path], object]:
    return lambda path: path.write_bytes(value.encode())


def doc(value: object) -> Callable[[Path], object]:
    return lambda path: path.write_text(json.dumps(value))


def folder(path: Path) -> None:
    path.mkdir()


def symlink(path: Path) -> None:
    target = path.with_name("real.json")
    target.write_text(json.dumps(GOOD))
    path.symlink_to(target)


def fifo(path: Path) -> None:
    os.mkfifo(path)  # opened for reading, it would block until a writer comes: none does


def rollout(**spec: object) -> dict[str, Any]:
    return {"format": 1, "rollouts": {"scaler": {**ROLLOUT, "spec": spec}}}


def routes(section: str, model: str, **entry: object) -> dict[str, Any]:
    return {"format": 1, "routes": {section: {model: {"canary_weight": 1, "at": 1, **entry}}}}


OVERRIDE_INFINITE = '{"format": 1, "routes": {"overrides": {"s": {"canary_weight": Infinity, "at": 1}}}}'

# (what is wrong, how to make such a file, words the line must have)
BAD: list[tuple[str, Callable[[Path], object], str]] = [
    ("empty", text(""), "is empty"),
    ("blank", text("\n  \n"), "is empty"),
    ("truncated", text(json.dumps(GOOD)[:45]), "not JSON"),
    ("not JSON", text("weights: 10\n"), "not JSON"),
    ("not UTF-8", lambda p: p.write_bytes(b'{"format": 1, "routes": "\xff\xfe"}'), "not UTF-8"),
    ("a list", doc([1, 2]), "not a sidecar state file"),
    ("no format", doc({"routes": {}}), "not a sidecar state file"),
    ("wrong shape", doc({"format": 1, "routes": []}), "routes: expected"),
    ("a wrong key", doc({"format": 1, "weights": {}}), "unknown key"),
    ("a wrong field", doc({"format": 1, "routes": {"overrides": {"scaler": {"at": 1}}}}), "canary_weight"),
    ("a string for a time", doc(routes("overrides", "s", at="x")), "routes.overrides.s.at"),
    ("Infinity", text(OVERRIDE_INFINITE), "finite"),
    ("NaN", text('{"format": 1, "rollouts": {"s": {"spec": {"dwell_s": NaN}}}}'), "finite"),
    ("1e999", text('{"format": 1, "rollouts": {"s": {"spec": {"max_latency_ratio": 1e999}}}}'), "finite"),
    ("a huge min_calls", doc(rollout(min_calls=2**70)), "min_calls"),
    ("a step it cannot be at", doc({"format": 1, "rollouts": {"scaler": {**ROLLOUT, "step": 7}}}), "step"),
    ("a bad model name", doc(routes("overrides", "../x")), "'../x'"),
    ("a bad rollout name", doc({"format": 1, "rollouts": {"a/b": ROLLOUT}}), "'a/b'"),
    ("a bad version", doc(routes("file", "s", canary="..2")), "'..2'"),
    ("a bad rollout canary", doc({"format": 1, "rollouts": {"s": {**ROLLOUT, "canary": "-2"}}}), "'-2'"),
    ("a folder", folder, "is a folder"),
    ("a symlink", symlink, "symbolic link"),
    ("a FIFO", fifo, "is a FIFO"),
]


def sidecar_exit(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m modelyard.sidecar ...` to its exit, bounded: a start that hangs fails the test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELYARD_")}
    cmd = [sys.executable, "-m", "modelyard.sidecar", "--listen", "127.0.0.1:0", "--admin-listen", ""]
    return subprocess.run(
        [*cmd, "--upstream", "127.0.0.1:9", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env=env,
    )


def one_line(result: subprocess.CompletedProcess[str], *named: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    for words in named:
        assert words in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(("what", "make", "words"), BAD, ids=[case[0] for case in BAD])
def test_a_state_file_that_is_not_the_sidecars_is_one_line_and_exit_2(
    tmp_path: Path, what: str, make: Callable[[Path], object], words: str
) -> None:
    state = tmp_path / "state.json"
    make(state)
    started = time.monotonic()
    result = sidecar_exit("--state-file", str(state))
    one_line(result, "modelyard sidecar: error: argument --state-file:", str(state), words)
    assert "MODELYARD_SIDECAR_STATE_FILE" in result.stderr
    assert time.monotonic() - started < 30  # a FIFO is never opened for a blocking read


def test_a_state_file_in_a_folder_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    state = tmp_path / "nowhere" / "state.json"
    one_line(sidecar_exit("--state-file", str(state)), "--state-file", "does not exist")


async def test_a_crashs_temporary_files_are_removed_at_start(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.write_text(json.dumps(GOOD))
    stale = [tmp_path / ".state.json.k2x9_q0a", tmp_path / ".state.json.abcdefgh"]
    kept = [tmp_path / ".state.json.notours", tmp_path / "other.json", tmp_path / ".other.json.abcdefgh"]
    for path in (*stale, *kept):
        path.write_text("{}")
    async with running_sidecar(["127.0.0.1:9"], state_file=str(state)) as sidecar:
        assert sidecar.routes.table.route("scaler").canary_weight == 10  # read as before
        assert not any(path.exists() for path in stale)
        assert all(path.exists() for path in kept)


async def test_a_change_that_cannot_be_written_is_an_error_not_200(tmp_path: Path) -> None:
    """Root passes any permission, so the folder goes: the write fails as on a full or read-only
    disk. The answer says so (5xx with its reason); once the folder is back the next change writes
    every change made."""
    holder = tmp_path / "state"
    holder.mkdir()
    state, config = holder / "state.json", tmp_path / "routes.yaml"
    config.write_text("models: {scaler: {canary_weight: 0}, other: {canary_weight: 0}}\n")
    async with (
        running_sidecar(["127.0.0.1:9"], config=config, state_file=str(state), admin_open=True) as sidecar,
        httpx.AsyncClient(base_url=f"http://{sidecar.admin_address}", timeout=10) as http,
    ):
        assert (await http.put("/canary/scaler", json={"canary_weight": 5})).status_code == 200
        assert json.loads(state.read_text())["routes"]["overrides"]["scaler"]["canary_weight"] == 5

        shutil.rmtree(holder)
        answer = await http.put("/canary/scaler", json={"canary_weight": 25})
        assert answer.status_code == 500 and answer.json()["reason"] == "internal", answer.text
        assert str(state) in answer.json()["error"] and "not kept" in answer.json()["error"]
        answer = await http.post("/rollouts/other", json={"steps": [10, 100]})
        assert answer.status_code == 500 and "not kept" in answer.json()["error"], answer.text
        # What the answer said: the changes apply now.
        assert sidecar.routes.table.route("scaler").canary_weight == 25
        assert sidecar.rollouts.rollouts["other"].state == "running"

        holder.mkdir()
        assert (await http.put("/canary/scaler", json={"canary_weight": 30})).status_code == 200
        saved = json.loads(state.read_text())
        assert saved["routes"]["overrides"]["scaler"]["canary_weight"] == 30
        assert saved["rollouts"]["other"]["state"] == "running"


MODELS = [f"m{i}" for i in range(6)]
ACKS = 240  # acknowledged changes before the kill, over all models


def put(url: str, weight: float) -> int:
    body = json.dumps({"canary_weight": weight}).encode()
    request = urllib.request.Request(
        url, data=body, method="PUT", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        answer.read()
        return int(answer.status)


def state_sidecar(
    sidecar_process: Callable[..., SidecarProcess], config: Path, state: Path
) -> tuple[SidecarProcess, str]:
    sidecar = sidecar_process(
        "--upstream", "127.0.0.1:9", "--config", str(config), "--state-file", str(state), admin_open=True
    )
    assert sidecar.admin_url is not None
    return sidecar, sidecar.admin_url


def test_an_acknowledged_change_survives_a_sigkill(
    tmp_path: Path, sidecar_process: Callable[..., SidecarProcess]
) -> None:
    """Writers change every model's weight in turn (0.01, 0.02, ...), each waiting for its answer;
    the sidecar is killed while changes are in flight. On disk, each model holds its last
    acknowledged weight, or the one after it (written, not yet answered), never an older one; a
    restart serves exactly that."""
    config, state = tmp_path / "routes.yaml", tmp_path / "state.json"
    config.write_text("models: {" + ", ".join(f"{m}: {{canary_weight: 0}}" for m in MODELS) + "}\n")
    sidecar, url = state_sidecar(sidecar_process, config, state)
    acked = dict.fromkeys(MODELS, 0)
    refused: list[str] = []
    enough = threading.Event()

    def writer(model: str) -> None:
        step = 0
        while True:
            step += 1
            try:
                status = put(f"{url}/canary/{model}", step / 100)
            except (OSError, urllib.error.URLError):
                return  # killed under it: not acknowledged
            if status != 200:
                refused.append(f"{model}: {status}")
                return
            acked[model] = step
            if sum(acked.values()) >= ACKS:
                enough.set()

    threads = [threading.Thread(target=writer, args=(m,), daemon=True) for m in MODELS]
    for thread in threads:
        thread.start()
    assert enough.wait(120), f"acknowledged {sum(acked.values())} changes"
    sidecar.proc.send_signal(signal.SIGKILL)
    sidecar.proc.wait(30)
    for thread in threads:
        thread.join(60)
    assert not refused, refused
    assert not any(thread.is_alive() for thread in threads)

    saved = json.loads(state.read_text())["routes"]["overrides"]
    on_disk = {m: round(saved[m]["canary_weight"] * 100) for m in MODELS}
    for model in MODELS:
        assert on_disk[model] in (acked[model], acked[model] + 1), (model, on_disk[model], acked[model])

    # The kill may have left a write's temporary file; one more, as if from an earlier crash.
    (tmp_path / ".state.json.zz0_zz0z").write_text('{"format": 1')
    again, url = state_sidecar(sidecar_process, config, state)
    with urllib.request.urlopen(f"{url}/canary", timeout=30) as answer:
        shown = json.loads(answer.read())["models"]
    assert {m: round(shown[m]["canary_weight"] * 100) for m in MODELS} == on_disk
    assert {shown[m]["source"] for m in MODELS} == {"state_file"}
    assert again.stop() == 0  # its own writes done
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".state.json.")] == []
