"""A real Envoy for the end-to-end tests: the config rendered by envoy/python/render.py with ephemeral
ports, its own --base-id (two Envoys on one host must not share hot-restart memory), stopped by
the test that started it."""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import struct
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelyard.envoy import render

ENVOY = Path(sys.executable).with_name("envoy")
# Hot-restart shared memory is keyed by --base-id: one per Envoy, unique across the processes of
# this host (other test runs included), from this process's id and a counter.
_BASE_IDS = itertools.count(1000 + (os.getpid() % 400_000) * 10)


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


@dataclass
class EnvoyProcess:
    proc: subprocess.Popen[bytes]
    admin: str
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_envoy(
    tmp: Path, gateway: str, sidecar: str, timeout_s: float = 30.0, **settings: Any
) -> EnvoyProcess:
    config = render.RenderSettings(
        listen=("127.0.0.1", 0),
        admin=("127.0.0.1", 0),
        gateway=_host_port(gateway),
        sidecar=_host_port(sidecar),
        **settings,
    )
    path = tmp / "envoy.yaml"
    path.write_text(render.render(config))
    admin_path = tmp / "admin-address"
    log = tmp / "envoy.log"
    base_id = next(_BASE_IDS)
    cmd = [str(ENVOY), "-c", str(path), "--base-id", str(base_id), "--admin-address-path", str(admin_path)]
    cmd += ["--log-level", "warn", "--log-path", str(log), "--concurrency", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    try:
        while True:  # the one polling wait: Envoy has no readiness signal but its admin /ready
            if proc.poll() is not None:
                raise AssertionError(
                    f"envoy exited {proc.returncode}: {log.read_text() if log.exists() else ''}"
                )
            if admin_path.exists() and admin_path.read_text().strip():
                admin = "http://" + admin_path.read_text().strip()
                try:
                    with urllib.request.urlopen(admin + "/ready", timeout=2) as response:
                        if response.read().strip() == b"LIVE":
                            break
                except OSError:
                    pass
            assert time.monotonic() < deadline, "envoy did not become ready"
            time.sleep(0.05)
        with urllib.request.urlopen(admin + "/listeners?format=json", timeout=5) as response:
            listeners = json.load(response)
        port = listeners["listener_statuses"][0]["local_address"]["socket_address"]["port_value"]
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return EnvoyProcess(proc, admin, int(port), log)


# --- gRPC-Web framing ---------------------------------------------------------------------------


def grpc_web_frame(message: bytes) -> bytes:
    return struct.pack(">BI", 0, len(message)) + message


def grpc_web_parse(body: bytes) -> tuple[list[bytes], dict[str, str]]:
    """Data frames (flag 0) and the trailer frame (flag 0x80: `name: value` lines)."""
    messages: list[bytes] = []
    trailers: dict[str, str] = {}
    offset = 0
    while offset < len(body):
        flag, length = struct.unpack_from(">BI", body, offset)
        payload = body[offset + 5 : offset + 5 + length]
        offset += 5 + length
        if flag & 0x80:
            for line in payload.decode().split("\r\n"):
                if line:
                    name, _, value = line.partition(":")
                    trailers[name.strip().lower()] = value.strip()
        else:
            messages.append(payload)
    return messages, trailers


def grpc_web_text_decode(text: str) -> bytes:
    """grpc-web-text: each chunk is base64 padded on its own, so decode piece by piece."""
    return b"".join(base64.b64decode(piece) for piece in re.findall(r"[A-Za-z0-9+/]+=*", text))
