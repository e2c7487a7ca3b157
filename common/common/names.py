"""The one rule for model names and versions that clients send, and the one cap on what an answer
echoes back. Every listener (the service's two APIs, the sidecar, the gateway) checks names here
at its edge, before a name reaches a path, a lock, a metric label, a breaker or a message, so a
hostile name is refused the same way everywhere: INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import re

# A letter or digit first (no hidden files, no `-flag` lookalikes), then letters, digits and
# `._-`; 128 characters at most; never `..` anywhere (no path can be spelled with it). Triton's
# and KServe's own model names fit: both are directory names in a repository.
NAME_MAX = 128
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Versions follow the same rule (numeric folders, `v<N>`, labels such as `canary`); an empty
# version means "the policy's choice" and is allowed where a version is optional.

# What an answer quotes of a client's value: this many characters, then `...`.
ECHO_MAX = 128


class InvalidName(ValueError):
    """A client-sent name or version that breaks the rule; the message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def name_problem(value: str) -> str | None:
    """Why `value` is not a valid model name, or None when it is."""
    if not value:
        return "is empty"
    if len(value) > NAME_MAX:
        return f"is longer than {NAME_MAX} characters"
    if ".." in value:
        return "contains '..'"
    if _NAME.fullmatch(value) is None:
        return "must start with a letter or digit and contain only letters, digits, '.', '_' and '-'"
    return None


def check_name(value: str, field: str = "model_name") -> str:
    """`value` when it is a valid model name; otherwise InvalidName naming `field`."""
    problem = name_problem(value)
    if problem is not None:
        raise InvalidName(field, f"{field} {echo(value)} {problem}")
    return value


def check_version(value: str, field: str = "model_version") -> str:
    """`value` when it is empty (no version asked for) or a valid version; otherwise InvalidName."""
    if not value:
        return value
    problem = name_problem(value)
    if problem is not None:
        raise InvalidName(field, f"{field} {echo(value)} {problem}")
    return value


def is_valid_name(value: str) -> bool:
    return name_problem(value) is None


def echo(value: object, limit: int = ECHO_MAX) -> str:
    """`value` as an answer may quote it: repr-quoted (so control characters and NULs show as
    escapes), at most `limit` characters of it, then `...`."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        return repr(text[:limit])[:-1] + "...'"
    return repr(text)
