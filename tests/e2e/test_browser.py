"""The browser page in Debian's headless Chromium (driven by playwright-core) through a real Envoy:
the models panel fills over gRPC-Web, a generation streams in with EventSource, and a screenshot is
saved as an artifact (tests/e2e/artifacts/page.png; `make test` installs chromium and gateway/web/'s npm
packages when missing)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from models import demo_models
from modelyard.gateway.app import Gateway
from modelyard.gateway.config import Settings as GatewaySettings
from modelyard.service.config import Settings
from modelyard.service.server import Service, build_service
from tests.envoy_support import start_envoy
from tests.sidecar_support import start_sidecar_process
from tests.support import REPO_ROOT

pytestmark = pytest.mark.asyncio(loop_scope="module")
# `make test` installs both (make browser-deps); a run without them fails rather than skips.
PLAYWRIGHT = REPO_ROOT / "gateway" / "web" / "node_modules" / "playwright-core"
SCRIPT = Path(__file__).with_name("browser_page.mjs")
ARTIFACTS = Path(__file__).with_name("artifacts")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    root = tmp_path_factory.mktemp("browser") / "models"
    demo_models.build_demo_repository(root)
    assert demo_models.copy_trained_models(demo_models.COMMITTED_ROOT, root) == ["codelm"]
    service: Service = build_service(Settings(repository=root, listen="127.0.0.1:0", metrics_listen=""))
    await service.start()
    sidecar = await asyncio.to_thread(
        start_sidecar_process, "--upstream", service.address, "--admin-listen", ""
    )
    upstream = sidecar.address
    gateway = Gateway(GatewaySettings(listen="127.0.0.1:0", upstream=upstream))
    await gateway.start()
    envoy = await asyncio.to_thread(start_envoy, tmp_path_factory.mktemp("envoy"), gateway.address, upstream)
    try:
        yield envoy.url
    finally:
        envoy.stop()
        await gateway.stop()
        sidecar.stop()
        await service.stop(grace_s=1.0)


async def test_page_lists_models_over_grpc_web_and_streams_a_generation(stack: str) -> None:
    assert shutil.which("chromium") and PLAYWRIGHT.exists(), "run `make browser-deps` (make test does)"
    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "page.png"
    screenshot.unlink(missing_ok=True)
    node = await asyncio.create_subprocess_exec(
        "node",
        str(SCRIPT),
        stack + "/",
        str(screenshot),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(node.communicate(), 120)
    assert node.returncode == 0, err.decode()
    result = json.loads(out.decode().strip().splitlines()[-1])
    assert sorted(result["models"]) == ["classifier", "codelm", "mixed", "scaler"], result
    grpc_web = [r for r in result["requests"] if "ListModels" in r]
    assert grpc_web and "application/grpc-web" in grpc_web[0]
    assert result["token_events"] > 1  # the text came as a stream of token events
    assert result["status"].startswith("done done: length, 40 tokens"), result
    assert len(result["output"]) > 20 and result["version"] == "1"
    # The dye the sidecar chose (stable or canary), or "none" where no sidecar runs.
    assert result["dye"] in ({"stable", "canary"} if importlib.util.find_spec("sidecar") else {"none"}), (
        result
    )
    assert screenshot.stat().st_size > 5000
