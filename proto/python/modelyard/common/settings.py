"""Settings of a process from its flags and environment: one frozen dataclass per process, every
field a flag (`--grace-s`) and a variable with the process's prefix (`MODELYARD_SERVICE_GRACE_S`).
Flags override the environment, which overrides the defaults.

Field types understood: str, int, float, bool, Path, and tuple[str, ...] (a repeatable flag; in
the environment, comma-separated). Booleans read `1/true/yes/on` and `0/false/no/off` (any case)
from the environment and anything else is an error naming the variable; flags are `--x`/`--no-x`.
"""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean (use true/false, 1/0, yes/no, on/off)")


def parse_settings(
    cls: type[T],
    prefix: str,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    prog: str,
    description: str,
    help: Mapping[str, str],
    choices: Mapping[str, Sequence[str]] | None = None,
) -> T:
    """Build `cls` (a dataclass whose fields all have defaults) from flags and `prefix`* variables.
    Bad values exit with status 2 and a message naming the flag or variable, as argparse does."""
    environ = os.environ if environ is None else environ
    choices = choices or {}
    types = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for item in fields(cls):  # type: ignore[arg-type]
        if item.default is MISSING and item.default_factory is MISSING:
            raise TypeError(f"{cls.__name__}.{item.name} needs a default")
        default = item.default if item.default is not MISSING else item.default_factory()  # type: ignore[operator]
        kind = types[item.name]
        env = prefix + item.name.upper()
        flag = "--" + item.name.replace("_", "-")
        text = f"{help[item.name]} (env {env}; default {_show(default)})"
        convert = _converter(kind)
        if env in environ:
            try:
                default = convert(environ[env])
            except ValueError as exc:
                parser.error(f"environment variable {env}: {exc}")
        if kind is bool:
            parser.add_argument(
                flag, dest=item.name, action=argparse.BooleanOptionalAction, default=default, help=text
            )
        elif _is_str_tuple(kind):
            parser.add_argument(flag, dest=item.name, action="append", default=None, help=text)
            parser.set_defaults(**{f"_default_{item.name}": default})
        else:
            parser.add_argument(
                flag, dest=item.name, type=convert, choices=choices.get(item.name), default=default, help=text
            )
    args = vars(parser.parse_args(argv))
    values = {}
    for item in fields(cls):  # type: ignore[arg-type]
        value = args[item.name]
        if _is_str_tuple(types[item.name]):
            value = tuple(value) if value is not None else args[f"_default_{item.name}"]
        values[item.name] = value
    return cls(**values)


def _converter(kind: Any) -> Callable[[str], Any]:
    if kind is bool:
        return parse_bool
    if _is_str_tuple(kind):
        return lambda text: tuple(part.strip() for part in text.split(",") if part.strip())
    if kind in (str, int, float, Path):
        return kind  # type: ignore[no-any-return]
    raise TypeError(f"settings fields of type {kind} are not supported")


def _is_str_tuple(kind: Any) -> bool:
    return typing.get_origin(kind) is tuple and typing.get_args(kind) == (str, Ellipsis)


def _show(value: object) -> str:
    if isinstance(value, tuple):
        return ",".join(value) or "none"
    return str(value) if value != "" else "empty"


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 hosts in brackets) -> (host, port)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)
