"""The service's edge check of client-sent model names and versions (modelyard.common.names, the
one rule): every servicer calls `check_model` with the request's fields before a name reaches the
manager, a path, a lock, a metric label or a message. A name that breaks the rule answers
INVALID_ARGUMENT naming the field (InvalidInput), never INTERNAL or NOT_FOUND."""

from __future__ import annotations

from collections.abc import Iterable

from modelyard.common.names import ECHO_MAX, InvalidName, check_name, check_version, echo
from modelyard.service.errors import InvalidInput


def check_model(
    name: str,
    version: str = "",
    *,
    name_field: str = "model_name",
    version_field: str = "model_version",
    optional: bool = False,
) -> None:
    """InvalidInput naming the field when `name` or `version` breaks the name rule. An empty
    version means "the policy's choice"; an empty name is refused unless `optional` (a request
    where no name means "every model" or "the server")."""
    if not version and name in _VALID:  # every inference call asks again for the same few names
        return
    try:
        if name or not optional:
            check_name(name, name_field)
        check_version(version, version_field)
    except InvalidName as exc:
        raise InvalidInput(str(exc)) from None
    if name and not version:
        if len(_VALID) >= _VALID_MAX:  # bounded: names a client makes up do not pile up
            _VALID.clear()
        _VALID.add(name)


# Names that passed the rule (check_model), so that the next request naming one skips it.
_VALID: set[str] = set()
_VALID_MAX = 4096


def check_names(names: Iterable[str], field: str) -> None:
    """Each of a request's repeated name fields (a watch filter)."""
    for name in names:
        check_model(name, name_field=field)


def quoted(value: object) -> str:
    """A client's value as an error message quotes it: a string as names.echo quotes it (repr,
    capped), anything else by its repr, capped the same way."""
    if isinstance(value, str):
        return echo(value)
    text = repr(value)
    return text if len(text) <= ECHO_MAX else text[:ECHO_MAX] + "..."


def clipped(text: str, limit: int = 4 * ECHO_MAX) -> str:
    """A parser's message, which may quote the client's input: at most `limit` characters."""
    return text if len(text) <= limit else text[:limit] + "..."
