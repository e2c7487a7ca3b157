"""`modelyard canary ...` against a real sidecar's admin endpoint, in a child process as an operator
runs it: the URL and token from the environment (or a token file), weights set and read, a rollout
started, paused and aborted; a missing token is refused (exit 1, the endpoint's words on stderr), and
so is any change by a sidecar with no credential configured; a number that is not finite is a usage
error before anything is sent."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from modelyard.sidecar.server import Sidecar
from tests.sidecar_support import running_sidecar

TOKEN = "cli-test-token"


def canary(
    sidecar: Sidecar, *args: str, token: str = TOKEN, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MODELYARD_ADMIN_")}
    env = {
        **base,
        "MODELYARD_ADMIN_URL": f"http://{sidecar.admin_address}",
        "MODELYARD_ADMIN_TOKEN": token,
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "modelyard.cli", "canary", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def run(
    sidecar: Sidecar, *args: str, token: str = TOKEN, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(canary, sidecar, *args, token=token, env=env)


async def test_weights_and_a_rollout_from_the_command_line(tmp_path: Path) -> None:
    config, tokens = tmp_path / "routes.yaml", tmp_path / "tokens"
    config.write_text("models: {scaler: {canary_weight: 0}}\n")
    tokens.write_text(TOKEN + "\n")
    async with running_sidecar(["127.0.0.1:9"], config=config, admin_tokens_file=str(tokens)) as sidecar:
        refused = await run(sidecar, "set", "scaler", "30", token="")
        assert refused.returncode == 1 and "401" in refused.stderr and "unauthenticated" in refused.stderr
        assert sidecar.routes.table.route("scaler").canary_weight == 0

        done = await run(sidecar, "set", "scaler", "30")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["canary_weight"] == 30
        shown = json.loads((await run(sidecar, "get", "scaler")).stdout)
        assert (shown["canary_weight"], shown["source"]) == (30, "admin")

        started = await run(sidecar, "rollout", "start", "scaler", "--steps", "10,50,100", "--dwell-s", "5")
        assert started.returncode == 0, started.stderr
        assert json.loads(started.stdout)["spec"]["steps"] == [10, 50, 100]
        assert sidecar.routes.table.route("scaler").canary_weight == 10
        assert json.loads((await run(sidecar, "rollout", "pause", "scaler")).stdout)["state"] == "paused"
        assert json.loads((await run(sidecar, "rollout", "abort", "scaler")).stdout)["state"] == "aborted"
        status = json.loads((await run(sidecar, "rollout", "status")).stdout)
        assert status["scaler"]["state"] == "aborted" and status["scaler"]["weight"] == 0
        again = await run(sidecar, "rollout", "resume", "scaler")
        assert again.returncode == 1 and "409" in again.stderr


async def test_the_token_from_a_file_and_a_sidecar_with_changes_off(tmp_path: Path) -> None:
    config, tokens = tmp_path / "routes.yaml", tmp_path / "tokens"
    config.write_text("models: {scaler: {canary_weight: 0}}\n")
    tokens.write_text(f"# the sidecar's own tokens file will do\n{TOKEN} management\n")
    async with running_sidecar(["127.0.0.1:9"], config=config, admin_tokens_file=str(tokens)) as sidecar:
        done = await run(sidecar, "--token-file", str(tokens), "set", "scaler", "15", token="")
        assert done.returncode == 0, done.stderr
        env = {"MODELYARD_ADMIN_TOKEN_FILE": str(tokens)}
        done = await run(sidecar, "set", "scaler", "20", token="", env=env)
        assert done.returncode == 0, done.stderr
        assert sidecar.routes.table.route("scaler").canary_weight == 20
        missing = await run(sidecar, "--token-file", str(tmp_path / "nope"), "set", "scaler", "1", token="")
        assert missing.returncode == 2 and "token file" in missing.stderr
        # A number that is not finite is refused before anything is sent.
        infinite = await run(sidecar, "rollout", "start", "scaler", "--dwell-s", "inf")
        assert infinite.returncode == 2 and "--dwell-s" in infinite.stderr, infinite.stderr
        assert "invalid finite number value: 'inf'" in infinite.stderr
        assert sidecar.rollouts.rollouts == {}

    async with running_sidecar(["127.0.0.1:9"], config=config) as sidecar:  # no credential, not open
        refused = await run(sidecar, "set", "scaler", "30", token="")
        assert refused.returncode == 1 and "403" in refused.stderr and "permission_denied" in refused.stderr
        assert "--admin-tokens-file" in refused.stderr and "--admin-open" in refused.stderr
        assert sidecar.routes.table.route("scaler").canary_weight == 0
        shown = await run(sidecar, "get", "scaler", token="")  # reads stay open
        assert shown.returncode == 0 and json.loads(shown.stdout)["canary_weight"] == 0
