"""The shared TLS and authorization helpers (modelyard.process.tls / auth), without sockets."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from modelyard.process.auth import Authorizer, AuthSettings, Decision, Scope
from modelyard.process.tls import TlsFiles, is_loopback, warn_if_plaintext


def test_loopback_addresses() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost", "127.1.2.3"))
    assert not any(is_loopback(h) for h in ("", "0.0.0.0", "[::]", "10.0.0.5", "example.com"))


def test_a_plaintext_listener_off_loopback_warns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    warn_if_plaintext("127.0.0.1", "the gRPC listener", None)
    assert not caplog.records
    warn_if_plaintext("0.0.0.0", "the gRPC listener", None)
    warn_if_plaintext("0.0.0.0", "the gRPC listener", TlsFiles(Path("c"), Path("k")))
    (record,) = caplog.records
    assert "without TLS" in record.getMessage()


def test_tls_files_from_settings() -> None:
    assert TlsFiles.from_settings("", "") is None
    assert TlsFiles.from_settings("c.pem", "k.pem", "ca.pem") == TlsFiles(
        Path("c.pem"), Path("k.pem"), Path("ca.pem")
    )
    for bad in (("c.pem", ""), ("", "k.pem"), ("", "", "ca.pem")):
        with pytest.raises(ValueError):
            TlsFiles.from_settings(*bad)


def test_tokens_and_identities(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# comment\n  alpha  \n\nbeta\n")
    authorizer = Authorizer(AuthSettings(tokens, ("svc-a",)))
    none: dict[str, list[bytes]] = {}
    assert authorizer.check([("authorization", "Bearer alpha")], none) is Decision.ALLOW
    assert authorizer.check([("authorization", "bearer beta")], none) is Decision.ALLOW
    assert authorizer.check([("authorization", "Bearer gamma")], none) is Decision.UNAUTHENTICATED
    assert authorizer.check([("authorization", "alpha")], none) is Decision.UNAUTHENTICATED
    assert authorizer.check([], none) is Decision.UNAUTHENTICATED
    assert authorizer.check([], {"x509_common_name": [b"svc-a"]}) is Decision.ALLOW
    assert authorizer.check([], {"x509_subject_alternative_name": [b"svc-a"]}) is Decision.ALLOW
    assert authorizer.check([], {"x509_common_name": [b"svc-b"]}) is Decision.DENIED
    assert not Authorizer(AuthSettings()).configured
    with pytest.raises(ValueError):
        Authorizer(AuthSettings(tmp_path / "missing"))


def test_token_scopes_and_identities(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("ops management\nuser inference\nboth\n")
    authorizer = Authorizer(AuthSettings(tokens, ("svc-a",)))
    none: dict[str, list[bytes]] = {}
    ops, user, both = ([("authorization", f"Bearer {t}")] for t in ("ops", "user", "both"))
    assert authorizer.check(ops, none, Scope.MANAGEMENT) is Decision.ALLOW
    assert authorizer.check(ops, none, Scope.INFERENCE) is Decision.DENIED
    assert authorizer.check(user, none, Scope.INFERENCE) is Decision.ALLOW
    assert authorizer.check(user, none) is Decision.DENIED  # the management scope by default
    assert all(authorizer.check(both, none, scope) is Decision.ALLOW for scope in Scope)
    # Identities: a valid token's digest (never the token), an allowed certificate, else anonymous.
    assert authorizer.identity(ops, none).startswith("token:") and "ops" not in authorizer.identity(ops, none)
    assert authorizer.identity(ops, none) != authorizer.identity(user, none)
    assert authorizer.identity([("authorization", "Bearer forged")], none) == ""
    assert authorizer.identity([], {"x509_common_name": [b"svc-a"]}) == "client:svc-a"
    assert authorizer.identity([], {"x509_common_name": [b"svc-b"]}) == ""


def test_an_unknown_scope_names_its_line_not_the_token(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# ops\nsecret-token admin\n")
    with pytest.raises(ValueError, match="line 2: unknown scope 'admin'") as raised:
        Authorizer(AuthSettings(tokens))
    assert "secret-token" not in str(raised.value)
