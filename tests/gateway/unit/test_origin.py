"""gateway/origin.py: which management requests a browser could send from another site's page
without a preflight (refused), and which it could not (passed on). Over the real gateway and
Envoy: tests/edge/security/test_default_edge.py."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from modelyard.gateway import origin


def headers(**values: str) -> Headers:
    return Headers({k.replace("_", "-"): v for k, v in values.items()})


@pytest.mark.parametrize(
    "method, given",
    [
        ("POST", {"origin": "http://evil.example", "content_type": "text/plain"}),
        ("POST", {"origin": "http://evil.example", "content_type": "text/plain;charset=UTF-8"}),
        ("POST", {"origin": "null", "content_type": "application/x-www-form-urlencoded"}),
        ("POST", {"origin": "http://evil.example", "content_type": "multipart/form-data; boundary=x"}),
        ("POST", {"origin": "http://evil.example"}),  # no content type (fetch with a Blob)
        ("PUT", {"origin": "http://evil.example", "content_type": "text/plain"}),
        ("DELETE", {"sec_fetch_site": "cross-site"}),
        ("POST", {"sec_fetch_site": "same-site", "content_type": "text/plain"}),
        ("POST", {"origin": "http://127.0.0.1:8000", "content_type": "text/plain"}),  # same origin too
        ("POST", {"origin": "http://evil.example", "content_type": "application/jsonx"}),
        ("POST", {"origin": "http://evil.example", "authorization": "Basic dTpw"}),  # cached by the browser
    ],
)
def test_a_request_a_page_could_send_unasked_is_cross_site(method: str, given: dict[str, str]) -> None:
    assert origin.cross_site(method, headers(**given))


@pytest.mark.parametrize(
    "method, given",
    [
        ("POST", {}),  # tritonclient.http: neither Origin nor a content type
        ("POST", {"content_type": "application/x-www-form-urlencoded"}),  # curl -d
        ("POST", {"sec_fetch_site": "same-origin", "content_type": "text/plain"}),
        ("POST", {"sec_fetch_site": "none"}),  # typed into the address bar, a bookmark
        ("POST", {"origin": "http://evil.example", "content_type": "application/json"}),  # needs a preflight
        ("POST", {"origin": "http://evil.example", "content_type": "Application/JSON; charset=utf-8"}),
        ("POST", {"origin": "http://evil.example", "content_type": "application/merge-patch+json"}),
        ("POST", {"origin": "http://evil.example", "authorization": "Bearer abc"}),  # needs a preflight
        ("GET", {"origin": "http://evil.example", "sec_fetch_site": "cross-site"}),  # changes nothing
        ("HEAD", {"origin": "http://evil.example"}),
        ("OPTIONS", {"origin": "http://evil.example"}),
    ],
)
def test_a_request_that_needs_a_preflight_or_changes_nothing_passes(
    method: str, given: dict[str, str]
) -> None:
    assert not origin.cross_site(method, headers(**given))
