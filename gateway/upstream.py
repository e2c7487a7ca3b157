"""The gRPC side: one channel to the sidecar, its stubs, and the headers that travel each way."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping

import grpc

from modelyard.common import headers, names
from modelyard.gateway import errors
from modelyard.gateway.tls import UpstreamTls
from modelyard.inference.v1 import inference_service_pb2_grpc as inference_grpc
from modelyard.inference.v1 import model_service_pb2_grpc as model_grpc
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kserve_grpc
from modelyard.process.tls import Renewals

log = logging.getLogger(__name__)
# How often the upstream TLS files are looked at again (stat), at most.
RECHECK_S = 1.0
# A channel replaced after its TLS files changed closes once its calls end, or after this long
# (long streams included); new calls go to the new channel at once.
RETIRED_GRACE_S = 3600.0

# HTTP request headers passed on as gRPC metadata: routing, identity and trace context, and the
# caller's credential (`authorization`), so a token-protected sidecar or service decides.
FORWARDED = (
    headers.MODEL_VERSION,
    headers.CANARY_WEIGHT,
    headers.USER_ID,
    headers.TENANT_ID,
    headers.REQUEST_ID,
    headers.PRIORITY,
    headers.AUTHORIZATION,
    headers.TRACEPARENT,
    headers.TRACESTATE,
    headers.BAGGAGE,
)
# gRPC response metadata returned to the HTTP client as headers. x-served-version, and the
# sidecar's x-model-dye and x-dye-fallback, come in the trailing metadata of a unary answer and in
# the initial metadata of a stream (docs/api.md).
RETURNED = (headers.SERVED_VERSION, headers.MODEL_DYE, headers.DYE_FALLBACK)

Metadata = tuple[tuple[str, str], ...]
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # the end of a call read with read()


def forward(request_headers: Mapping[str, str]) -> Metadata:
    """The forwarded headers as metadata; a value gRPC cannot carry (not printable ASCII) is a 400
    naming the header, and a malformed x-model-version one too (the names rule)."""
    out = tuple(
        (name, metadata_value(request_headers[name], name)) for name in FORWARDED if request_headers.get(name)
    )
    version = request_headers.get(headers.MODEL_VERSION)
    if version:
        try:
            names.check_version(version, headers.MODEL_VERSION)
        except names.InvalidName as exc:
            raise errors.bad_request(str(exc)) from None
    return out


def metadata_value(value: str, name: str) -> str:
    """A value that may travel as gRPC metadata: printable ASCII only (else 400 naming it; the
    value is not quoted: it may be a credential)."""
    if not value.isascii() or not value.isprintable():
        raise errors.bad_request(f"{name}: the value must be printable ASCII (gRPC metadata)")
    return value


def returned(*metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """The response headers to return from an upstream call's metadata: its initial metadata, and
    for a unary call its trailing metadata too (where x-served-version rides)."""
    out: dict[str, str] = {}
    for pairs in metadata:
        for key, value in pairs or ():
            if key in RETURNED and isinstance(value, str):
                out[key] = value
    return out


class Upstream:
    """The channel and stubs; created inside the running event loop (grpc.aio binds to it). With
    TLS, a change of the CA or client certificate files (a renewal) is picked up without a restart:
    the next call after it goes over a new channel made with them."""

    def __init__(
        self, address: str, timeout_s: float, lookahead_bytes: int = 0, tls: UpstreamTls | None = None
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s or None
        # Messages as large as the service accepts (its --max-message-bytes default), not gRPC's 4 MiB.
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            # An address that resolves to several sidecars (dns:///a headless Kubernetes Service,
            # ipv4:a,b) gets calls spread over all of them, not pinned to the first; one address:
            # the same as gRPC's default.
            ("grpc.lb_policy_name", "round_robin"),
        ]
        if lookahead_bytes > 0:
            options += [("grpc.http2.lookahead_bytes", lookahead_bytes), ("grpc.http2.bdp_probe", 0)]
        self._options = options + (tls.options() if tls is not None else [])
        self._renewals = Renewals(tls) if tls is not None else None
        self._checked = time.monotonic()
        self._retired: set[asyncio.Task[None]] = set()
        self._connect(tls.credentials() if tls is not None else None)

    def _connect(self, credentials: grpc.ChannelCredentials | None) -> None:
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(self.address, options=self._options)
        else:
            self.channel = grpc.aio.secure_channel(self.address, credentials, options=self._options)
        self._inference = inference_grpc.InferenceServiceStub(self.channel)
        self._models = model_grpc.ModelServiceStub(self.channel)
        self._kserve = kserve_grpc.GRPCInferenceServiceStub(self.channel)

    @property
    def inference(self) -> inference_grpc.InferenceServiceAsyncStub:
        self._refresh()
        return self._inference

    @property
    def models(self) -> model_grpc.ModelServiceAsyncStub:
        self._refresh()
        return self._models

    @property
    def kserve(self) -> kserve_grpc.GRPCInferenceServiceAsyncStub:
        self._refresh()
        return self._kserve

    def _refresh(self) -> None:
        now = time.monotonic()
        if self._renewals is None or now - self._checked < RECHECK_S:
            return
        self._checked = now
        credentials = self._renewals.renewed()
        if credentials is None:
            return
        old = self.channel
        self._connect(credentials)
        retiring = asyncio.get_running_loop().create_task(old.close(RETIRED_GRACE_S))
        self._retired.add(retiring)
        retiring.add_done_callback(self._retired.discard)
        log.info("upstream TLS files reloaded; new calls use a new channel to %s", self.address)

    async def close(self) -> None:
        await self.channel.close(None)
        for retiring in list(self._retired):
            retiring.cancel()
        await asyncio.gather(*self._retired, return_exceptions=True)
