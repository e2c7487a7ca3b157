"""Cross-site requests cannot manage the server: the gateway's port is reachable by any web page
open in a browser on the same host, and a page may send some requests to another origin without
asking first (no CORS preflight): a POST whose content type is `text/plain`,
`application/x-www-form-urlencoded`, `multipart/form-data` or none, and without an Authorization
header. Such a request acts even though the page never reads the answer.

So a management request (modelyard.common.surfaces.is_management_path) with a state-changing
method (anything but GET, HEAD, OPTIONS) that looks like a browser's (an `Origin` header, which
browsers send with every cross-origin request and every POST, or a `Sec-Fetch-Site` other than
`same-origin`/`none`) is refused 403 `permission_denied` before anything reads it, unless its
content type is JSON or it carries a bearer token: a page can send either only after a preflight,
which the gateway never grants (it answers no OPTIONS on management routes). (Only `Bearer`: a
browser attaches cached Basic credentials to a cross-site request by itself.)
Clients that are not browsers (curl, tritonclient) send neither header and are not affected.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from modelyard.common import headers as names
from modelyard.common.reasons import ErrorReason
from modelyard.common.surfaces import is_management_path

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Sec-Fetch-Site values of requests no other site's page started.
OWN_SITE = frozenset({"same-origin", "none"})
MESSAGE = (
    "a browser's cross-site request cannot manage this server: a management request needs"
    " content-type: application/json or an authorization: Bearer token, which a page on another"
    " site cannot send without a CORS preflight (docs/security.md)"
)


def is_json(content_type: str) -> bool:
    """`application/json` or a `+json` type, parameters aside (what no page sends unasked)."""
    essence = content_type.split(";", 1)[0].strip().lower()
    return essence == "application/json" or (essence.startswith("application/") and essence.endswith("+json"))


def cross_site(method: str, headers: Headers) -> bool:
    """Whether a browser could have sent this state-changing request from another site's page
    without a preflight."""
    if method.upper() in SAFE_METHODS:
        return False
    fetch_site = headers.get("sec-fetch-site")
    browser = "origin" in headers or (fetch_site is not None and fetch_site.strip().lower() not in OWN_SITE)
    if not browser:
        return False
    bearer = headers.get("authorization", "").strip().lower().startswith("bearer ")
    return not is_json(headers.get("content-type", "")) and not bearer


class CrossSiteGuard:
    """ASGI middleware: management requests that `cross_site` holds for are answered 403 in the
    KServe error body (every management route is KServe's), nothing of them read."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and is_management_path(scope["path"])
            and cross_site(scope["method"], Headers(scope=scope))
        ):
            reason = ErrorReason.PERMISSION_DENIED
            body = {"error": MESSAGE, "code": "PERMISSION_DENIED", "reason": reason}
            response = JSONResponse(body, status_code=403, headers={names.ERROR_REASON: reason})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
