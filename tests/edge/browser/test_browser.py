"""The browser page in Debian's headless Chromium (driven by playwright-core, tests/edge/
browser/browser_page.mjs) through a real Envoy, sidecar and service: the models panel over gRPC-Web, a
generation read with fetch, the server's refusals in its own words, stop, keyboard use, the layout
at 1280 and 390 px (no horizontal scroll), the favicon; a closed tab whose generation pauses within
a few tokens and is cancelled when the resume window ends; and, on the gateway's own port, the
models note and a crash worded for a person. Screenshots go to tests/edge/browser/artifacts/ (gitignored):
page-1280.png, page-1280-error.png, page-390.png, page-390-error.png, page-390-crash.png.
`make test` installs chromium and gateway/web/'s npm packages when missing (make browser-deps)."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from models import demo_models
from modelyard.gateway.app import Gateway
from modelyard.gateway.settings import Settings as GatewaySettings
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from tests.envoy_support import start_envoy
from tests.sidecar_support import start_sidecar_process
from tests.support import REPO_ROOT, eventually, start_service_process

pytestmark = pytest.mark.asyncio(loop_scope="module")
# `make test` installs both (make browser-deps); a run without them fails rather than skips.
PLAYWRIGHT = REPO_ROOT / "gateway" / "web" / "node_modules" / "playwright-core"
SCRIPT = Path(__file__).with_name("browser_page.mjs")
ARTIFACTS = Path(__file__).with_name("artifacts")
# Short, so the test need not wait the default 20 s; every other gateway setting is the default
# (the one-byte upstream lookahead among them).
WINDOW_S = 3.0
# A closed tab's sequence pauses once the gateway stops reading: the service's stream buffer of
# the demo model (16 tokens) and a message or two in flight. Far below its 256-token run.
PAUSE_BOUND_TOKENS = 96
CLOSING = "closing"


@dataclass
class Stack:
    url: str
    service: Service
    gateway: Gateway


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    root = tmp_path_factory.mktemp("browser") / "models"
    demo_models.build_demo_repository(root)
    assert demo_models.copy_trained_models(demo_models.COMMITTED_ROOT, root) == ["codelm"]
    shutil.copytree(root / "codelm", root / CLOSING)  # the closed tab's, so its metrics are its own
    service: Service = build_service(Settings(repository=root, listen="127.0.0.1:0", metrics_listen=""))
    await service.start()
    sidecar = await asyncio.to_thread(
        start_sidecar_process, "--upstream", service.address, "--admin-listen", ""
    )
    upstream = sidecar.address
    gateway = Gateway(GatewaySettings(listen="127.0.0.1:0", upstream=upstream, resume_window_s=WINDOW_S))
    await gateway.start()
    envoy = await asyncio.to_thread(start_envoy, tmp_path_factory.mktemp("envoy"), gateway.address, upstream)
    try:
        yield Stack(envoy.url, service, gateway)
    finally:
        envoy.stop()
        await gateway.stop()
        sidecar.stop()
        await service.stop(grace_s=1.0)


async def drive(
    mode: str,
    url: str,
    on_mark: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
    model: str = "codelm",
) -> dict[str, Any]:
    """Run browser_page.mjs in `mode`; `on_mark` sees each progress mark as it comes."""
    assert shutil.which("chromium") and PLAYWRIGHT.exists(), "run `make browser-deps` (make test does)"
    ARTIFACTS.mkdir(exist_ok=True)
    node = await asyncio.create_subprocess_exec(
        "node",
        str(SCRIPT),
        mode,
        url + "/",
        str(ARTIFACTS),
        model,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert node.stdout is not None and node.stderr is not None
    last: dict[str, Any] = {}
    try:
        async with asyncio.timeout(180):
            async for line in node.stdout:
                document = json.loads(line)
                if "mark" in document and on_mark is not None:
                    await on_mark(document)
                last = document
            err = await node.stderr.read()
            await node.wait()
    finally:
        if node.returncode is None:
            node.kill()
            await node.wait()
    assert node.returncode == 0, err.decode()
    return last


def metric(service: Service, name: str, model: str = "codelm", **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, {"model": model, "version": "1", **labels})
    return value or 0.0


async def test_the_page_through_envoy_at_both_widths(stack: Stack) -> None:
    for name in ("page-1280.png", "page-1280-error.png", "page-390.png", "page-390-error.png"):
        (ARTIFACTS / name).unlink(missing_ok=True)
    result = await drive("page", stack.url)

    # The panel lists every model over gRPC-Web; the generate box offers the decoder only.
    assert sorted(result["models"]) == ["classifier", CLOSING, "codelm", "mixed", "scaler"], result
    assert any("ListModels" in r and "application/grpc-web" in r for r in result["requests"])
    assert result["offered"] == [CLOSING, "codelm"]
    assert result["a11y"] == {
        "unlabelled": [],
        "status_live": "polite",
        "status_role": "status",
        "icon": "/favicon.ico",
    }
    assert result["favicon"]["status"] == 200 and result["favicon"]["type"] == "image/x-icon"
    assert result["favicon"]["bytes"] > 100
    assert not [r for r in result["failed_responses"] if "favicon" in r], result["failed_responses"]

    # A generation, read with fetch: a stream of token events, then done.
    assert result["done"]["state"] == "done" and "length, 40 tokens" in result["done"]["text"], result
    assert result["token_events"] > 1 and len(result["output"]) > 20 and result["version"] == "1"
    assert result["dye"] in {"stable", "canary"}  # the sidecar's choice

    # The server's message and reason, not "the stream could not be opened".
    errors = result["errors"]
    assert errors["prompt"]["state"] == "error" and "prompt: required" in errors["prompt"]["text"], errors
    assert "invalid_argument" in errors["prompt"]["text"]
    assert "max_tokens" in errors["max_tokens"]["text"] and "exceeds" in errors["max_tokens"]["text"]
    assert "is not a decoder" in errors["decoder"]["text"] and "; use Infer" in errors["decoder"]["text"]
    assert all(e["text"].startswith("Refused: ") for e in errors.values())

    # Stop stops: nothing arrives after it and the buttons swap back. (What the server does once
    # the page's connection goes, as it does here, is the closed-tab test's.)
    during = result["during"]
    assert during["state"] == "streaming", during
    assert during["generate_disabled"] is True and during["stop_disabled"] is False, during
    stop = result["stop"]
    assert stop["state"] == "stopped" and stop["after"] == stop["at_stop"] >= 3, stop
    # The keyboard: Ctrl+Enter started, a second one did not replace the stream, Esc stopped it.
    keyboard = result["keyboard"]
    assert keyboard["kept"] is True and keyboard["running"] == "streaming", keyboard
    assert keyboard["state"] == "stopped", keyboard
    assert keyboard["text"].startswith("Stopped after")

    # Readable at both widths: no horizontal scroll (long prompt and error included), one column
    # on the phone.
    for key in ("wide_scroll", "phone_scroll", "phone_error_scroll"):
        assert result[key]["ok"], (key, result[key])
    assert result["phone_columns"]["stacked"]
    assert result["phone_done"]["state"] == "done"
    assert result["phone_error"]["state"] == "error" and "exceeds" in result["phone_error"]["text"]
    for name in ("page-1280.png", "page-1280-error.png", "page-390.png", "page-390-error.png"):
        assert (ARTIFACTS / name).stat().st_size > 5000, name


async def test_a_closed_tab_pauses_its_generation_and_the_window_cancels_it(stack: Stack) -> None:
    service = stack.service

    def closing(name: str, **labels: str) -> float:
        return metric(service, name, CLOSING, **labels)

    closed: dict[str, float] = {}

    async def on_mark(mark: dict[str, Any]) -> None:
        if mark["mark"] == "closed":
            closed["at"] = time.monotonic()
            closed["tokens"] = closing("modelyard_generation_tokens_total")

    # The tab closes at its first token. On a loaded machine the demo model (a few ms a token)
    # can still finish its 256 tokens before the browser gets there: then the scenario did not
    # happen (the generation ended by length) and is run again, at most three times.
    for _attempt in range(3):
        ended = closing("modelyard_generation_finished_total", reason="length")
        started = closing("modelyard_generation_tokens_total")  # a counter: earlier attempts stay in it
        result = await drive("close-tab", stack.url, on_mark, model=CLOSING)
        if closing("modelyard_generation_finished_total", reason="length") == ended:
            break
    else:
        raise AssertionError("the generation ended before its tab closed, three times")
    assert "at" in closed and result["status_code"] == 200, result
    # Paused, not cancelled: the slot is held for a resume (no decode steps run for it).
    assert time.monotonic() - closed["at"] < WINDOW_S
    assert closing("modelyard_generation_active_sequences") == 1
    assert closing("modelyard_generation_cancellations_total", cause="cancelled") == 0
    # The window ends: the gateway cancels the call, the service frees the sequence.
    await eventually(
        lambda: (
            closing("modelyard_generation_cancellations_total", cause="cancelled") == 1
            and closing("modelyard_generation_active_sequences") == 0
        ),
        "the cancellation",
        within_s=WINDOW_S + 15,
    )
    assert time.monotonic() - closed["at"] >= WINDOW_S - 0.5
    final = closing("modelyard_generation_tokens_total")
    assert final - closed["tokens"] <= PAUSE_BOUND_TOKENS, (closed, final)
    # Held paused to the end: cancelled by the window, never run on to its 256-token end (how
    # many tokens came before the close depends on how fast the browser closed the tab).
    assert closing("modelyard_generation_finished_total", reason="length") == ended
    assert final - started < 256


async def test_on_the_gateway_port_the_page_says_where_to_open_it_and_words_a_crash(
    tmp_path: Path,
) -> None:
    (ARTIFACTS / "page-390-crash.png").unlink(missing_ok=True)
    root = tmp_path / "models"
    shutil.copytree(demo_models.COMMITTED_ROOT / "codelm", root / "codelm")
    # The service dies once tokens stream. A fast model on a quiet machine can finish its 256 tokens
    # before the kill lands: then the scenario did not happen (the page says "done"), and it is run
    # again with a fresh service, at most three times.
    for _attempt in range(3):
        service = await asyncio.to_thread(start_service_process, root)
        gateway = Gateway(GatewaySettings(listen="127.0.0.1:0", upstream=service.address))
        await gateway.start()

        async def on_mark(mark: dict[str, Any], service: Any = service) -> None:
            if mark["mark"] == "streaming":
                service.stop(signal.SIGKILL)  # the service dies mid-generation

        try:
            result = await drive("crash", gateway.url, on_mark)
        finally:
            service.stop(signal.SIGKILL)
            await gateway.stop()
        if result["crash"]["state"] != "done":
            break
    assert "needs gRPC-Web, which Envoy serves" in result["models_note"], result
    assert "browser page" in result["models_note"]
    crash = result["crash"]
    assert crash["state"] == "error", crash
    assert crash["text"].startswith("The model server stopped answering during this generation"), crash
    assert "unavailable" in crash["text"]  # the server's reason, among the details
    assert result["crash_scroll"]["ok"], result["crash_scroll"]
    assert (ARTIFACTS / "page-390-crash.png").stat().st_size > 5000
