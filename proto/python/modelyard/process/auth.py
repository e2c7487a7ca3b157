"""Who may call: bearer tokens from a file, or (with mTLS) an allowed client certificate identity.

Tokens are kept as SHA-256 digests and a presented token is compared with every one of them in
constant time, so neither timing nor memory says which part of a token was wrong. The token file
(one token per line, `#` comments) is re-read when it changes, without a restart.

`Authorizer.check` answers ALLOW, UNAUTHENTICATED (no usable credential) or DENIED (a verified
client certificate whose identity is not allowed); callers map them to their protocol's status and
send the same few words whatever was wrong.
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
        self._digests: tuple[bytes, ...] = ()
        self._stamp: tuple[object, ...] | None = None
        self._checked = 0.0
        if settings.tokens_file is not None:
            self._reload(force=True)

    @property
    def configured(self) -> bool:
        return self.settings.configured

    def check(
        self, metadata: Iterable[tuple[str, str | bytes]], peer: Mapping[str, Iterable[bytes]]
    ) -> Decision:
        """`metadata`: the call's headers; `peer`: gRPC's auth context (x509_common_name, ...)."""
        if self._names:
            identities = {*peer.get("x509_common_name", ()), *peer.get("x509_subject_alternative_name", ())}
            if identities & self._names:
                return Decision.ALLOW
        token = _bearer(metadata)
        if token is not None and self.settings.tokens_file is not None and self._token_ok(token):
            return Decision.ALLOW
        if token is None and self._names and any(peer.get("x509_common_name", ())):
            return Decision.DENIED  # a verified certificate, but not one allowed here
        return Decision.UNAUTHENTICATED

    def _token_ok(self, token: str) -> bool:
        self._reload()
        presented = hashlib.sha256(token.encode()).digest()
        ok = False
        for digest in self._digests:  # no early exit: the time does not say which token matched
            ok |= hmac.compare_digest(presented, digest)
        return ok

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
            tokens = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
            self._digests = tuple(hashlib.sha256(t.encode()).digest() for t in tokens)
            self._stamp = stamp
            log.info("auth: %d token(s) loaded from %s", len(self._digests), path)


def _bearer(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    for key, value in metadata:
        if key == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None
