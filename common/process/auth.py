"""Who may call: bearer tokens from a file, or (with mTLS) an allowed client certificate identity.

Tokens are kept as SHA-256 digests and a presented token is compared with every one of them in
constant time, so neither timing nor memory says which part of a token was wrong. The token file
(one token per line, `#` comments) is re-read when it changes, without a restart. A line is a
token, optionally followed by the scopes it holds (`s3cret inference`): `management` (load and
unload models, shared memory, log and trace settings) and `inference` (inference, generation and
metadata where those need a credential). A token without scopes holds both; an allowed mTLS
client identity holds both.

`Authorizer.check` answers ALLOW, UNAUTHENTICATED (no usable credential) or DENIED (a verified
client certificate whose identity is not allowed, or a valid token without the call's scope);
callers map them to their protocol's status and send the same few words whatever was wrong.
`Authorizer.identity` names the caller for what it owns (shared-memory regions): the digest of
a valid token, an allowed certificate identity, or "" for an anonymous caller.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# How often the token file is looked at again (stat), at most.
RECHECK_S = 1.0


class Decision(enum.Enum):
    ALLOW = "allow"
    UNAUTHENTICATED = "unauthenticated"
    DENIED = "denied"


class Scope(enum.Enum):
    MANAGEMENT = "management"
    INFERENCE = "inference"


EVERY_SCOPE = frozenset(Scope)


@dataclass(frozen=True)
class AuthSettings:
    tokens_file: Path | None = None
    client_names: tuple[str, ...] = ()  # allowed mTLS client identities (certificate CN or SAN)

    @property
    def configured(self) -> bool:
        return self.tokens_file is not None or bool(self.client_names)


class Authorizer:
    def __init__(self, settings: AuthSettings) -> None:
        self.settings = settings
        self._names = frozenset(name.encode() for name in settings.client_names)
        self._lock = threading.Lock()
        self._digests: tuple[tuple[bytes, frozenset[Scope]], ...] = ()
        self._stamp: tuple[object, ...] | None = None
        self._checked = 0.0
        if settings.tokens_file is not None:
            self._reload(force=True)

    @property
    def configured(self) -> bool:
        return self.settings.configured

    def check(
        self,
        metadata: Iterable[tuple[str, str | bytes]],
        peer: Mapping[str, Iterable[bytes]],
        scope: Scope = Scope.MANAGEMENT,
    ) -> Decision:
        """`metadata`: the call's headers; `peer`: gRPC's auth context (x509_common_name, ...)."""
        if self._allowed_name(peer):
            return Decision.ALLOW
        token = _bearer(metadata)
        scopes = self._token_scopes(token) if token is not None else None
        if scopes is not None:
            return Decision.ALLOW if scope in scopes else Decision.DENIED
        if token is None and self._names and any(peer.get("x509_common_name", ())):
            return Decision.DENIED  # a verified certificate, but not one allowed here
        return Decision.UNAUTHENTICATED

    def identity(
        self, metadata: Iterable[tuple[str, str | bytes]], peer: Mapping[str, Iterable[bytes]]
    ) -> str:
        """Who the caller is, for what it owns: `token:<digest>` for a valid token (whatever its
        scopes), `client:<name>` for an allowed certificate identity, "" for anyone else."""
        token = _bearer(metadata)
        if token is not None and self._token_scopes(token) is not None:
            return "token:" + hashlib.sha256(token.encode()).hexdigest()[:32]
        name = self._allowed_name(peer)
        return "client:" + name.decode(errors="replace") if name else ""

    def _allowed_name(self, peer: Mapping[str, Iterable[bytes]]) -> bytes:
        if not self._names:
            return b""
        for key in ("x509_common_name", "x509_subject_alternative_name"):
            for name in peer.get(key, ()):
                if name in self._names:
                    return name
        return b""

    def _token_scopes(self, token: str) -> frozenset[Scope] | None:
        """The scopes of a valid token; None for a token that is not one."""
        if self.settings.tokens_file is None:
            return None
        self._reload()
        presented = hashlib.sha256(token.encode()).digest()
        found: frozenset[Scope] | None = None
        for digest, scopes in self._digests:  # no early exit: the time does not say which matched
            if hmac.compare_digest(presented, digest):
                found = scopes
        return found

    def _reload(self, force: bool = False) -> None:
        path = self.settings.tokens_file
        assert path is not None
        now = time.monotonic()
        if not force and now - self._checked < RECHECK_S:
            return
        with self._lock:
            self._checked = now
            try:
                st = path.stat()
                stamp: tuple[object, ...] = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
                if stamp == self._stamp:
                    return
                lines = path.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                if force:
                    raise ValueError(f"auth tokens file {path}: cannot read it ({exc})") from None
                log.warning("auth tokens file %s cannot be read (%s); keeping the previous tokens", path, exc)
                return
            try:
                entries = _parse_tokens(lines)
            except ValueError as exc:
                if force:
                    raise ValueError(f"auth tokens file {path}: {exc}") from None
                log.warning("auth tokens file %s: %s; keeping the previous tokens", path, exc)
                return
            self._digests = tuple((hashlib.sha256(t.encode()).digest(), scopes) for t, scopes in entries)
            self._stamp = stamp
            log.info("auth: %d token(s) loaded from %s", len(self._digests), path)


def _parse_tokens(lines: Iterable[str]) -> list[tuple[str, frozenset[Scope]]]:
    """`TOKEN [SCOPE ...]` per line; ValueError naming the line of an unknown scope (the token is
    never quoted: it is a secret)."""
    known = {scope.value: scope for scope in Scope}
    entries = []
    for number, line in enumerate(lines, 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        token, *asked = words
        unknown = [word for word in asked if word not in known]
        if unknown:
            raise ValueError(
                f"line {number}: unknown scope {unknown[0][:32]!r} (scopes: {', '.join(sorted(known))})"
            )
        entries.append((token, frozenset(known[w] for w in asked) if asked else EVERY_SCOPE))
    return entries


def _bearer(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    for key, value in metadata:
        if key == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None
