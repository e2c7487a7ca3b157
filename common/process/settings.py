"""Settings of a process from its flags and environment: one frozen dataclass per process, every
field a flag (`--grace-s`) and a variable with the process's prefix (`MODELYARD_SERVICE_GRACE_S`).
Flags override the environment, which overrides the defaults.

Each field is declared once: its type, default, help and allowed values, as
`name: Annotated[float, Meta(ge=0, description="...")] = 10.0`, and that one declaration gives the
flag, the variable, `--help`, the validation (msgspec's, the same for flags and variables) and the
docs' tables (`options`). Types understood: str, int, float, bool, Path, a `Literal` of strings
(the allowed values, matched in any case) and tuple[str, ...] (a repeatable flag; in the
environment, comma-separated). Booleans read `1/true/yes/on` and `0/false/no/off` (any case) from
the environment; flags are `--x`/`--no-x`. A bad value, from a flag or a variable, exits with
status 2 and one line naming the flag, the variable and the value; a variable with the prefix that
names no setting is warned about (one line each).
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from modelyard.process.documents import bounds

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


@dataclass(frozen=True)
class Option:
    """One setting as declared: what the parser, `--help` and the docs' tables need of it."""

    name: str
    flag: str
    env: str
    annotation: Any  # the declared type, constraints included (what msgspec validates against)
    kind: Any  # the bare type: bool, int, float, str, Path or tuple
    default: Any
    help: str
    choices: tuple[str, ...]  # from a Literal; empty: any value of the type
    bounds: str  # e.g. ">= 0", from the declaration's constraints; empty: none
    # Declared checks beyond msgspec's (`Meta(extra={"check": fn})`): fn raises ValueError.
    checks: tuple[Callable[[Any], None], ...] = ()

    @property
    def shown_default(self) -> str:
        value = self.default
        if isinstance(value, tuple):
            return ",".join(value) or "none"
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(value) if value != "" else "empty"

    @property
    def expects(self) -> str:
        """What a value must be, in words, for error messages."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        noun = {int: "an integer", float: "a number"}.get(self.kind, "a value")
        return f"{noun} {self.bounds}".strip()


def options(cls: type, prefix: str) -> list[Option]:
    """The settings `cls` declares, in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    found = []
    for item in fields(cls):
        if item.default is MISSING and item.default_factory is MISSING:
            raise TypeError(f"{cls.__name__}.{item.name} needs a default")
        default = item.default if item.default is not MISSING else item.default_factory()  # type: ignore[operator]
        annotation = hints[item.name]
        kind, metas = annotation, []
        if typing.get_origin(kind) is typing.Annotated:
            kind, *extras = typing.get_args(kind)
            metas = [m for m in extras if isinstance(m, msgspec.Meta)]
        allowed: tuple[str, ...] = ()
        if typing.get_origin(kind) is typing.Literal:
            allowed = tuple(str(c) for c in typing.get_args(kind))
            kind = str
        elif typing.get_origin(kind) is tuple:
            if typing.get_args(kind) != (str, Ellipsis):
                raise TypeError(f"{cls.__name__}.{item.name}: only tuple[str, ...] is supported")
            kind = tuple
        elif kind not in (str, int, float, bool, Path):
            raise TypeError(f"settings fields of type {kind} are not supported")
        description = " ".join(m.description for m in metas if m.description)
        if not description:
            raise TypeError(f"{cls.__name__}.{item.name} needs a description (its --help)")
        found.append(
            Option(
                name=item.name,
                flag="--" + item.name.replace("_", "-"),
                env=prefix + item.name.upper(),
                annotation=annotation,
                kind=kind,
                default=default,
                help=description,
                choices=allowed,
                bounds=bounds(metas),
                checks=tuple(m.extra["check"] for m in metas if m.extra and "check" in m.extra),
            )
        )
    return found


def convert(option: Option, raw: Any) -> Any:
    """A flag's or variable's value as the setting's type, checked against its declaration.
    Raises ValueError saying what the value must be."""
    value = _convert(option, raw)
    for check in option.checks:
        check(value)
    return value


def _convert(option: Option, raw: Any) -> Any:
    if option.kind is bool:
        return parse_bool(raw) if isinstance(raw, str) else bool(raw)
    if option.choices:
        by_case = {c.lower(): c for c in option.choices}
        value = by_case.get(str(raw).strip().lower())
        if value is None:
            raise ValueError(f"{raw!r} is not {option.expects}")
        return value
    if option.kind is Path:
        return Path(raw)
    if option.kind is tuple:
        parts = raw.split(",") if isinstance(raw, str) else raw
        raw = [part.strip() for part in parts if part.strip()]
    try:
        return msgspec.convert(raw, option.annotation, strict=False)
    except msgspec.ValidationError:
        raise ValueError(f"{raw!r} is not {option.expects}") from None


def describe(option: Option) -> str:
    """The `--help` text of one setting."""
    allowed = f"{option.bounds}; " if option.bounds else ""
    return f"{option.help} ({allowed}env {option.env}; default {option.shown_default})"


def parse_settings(
    cls: type[T],
    prefix: str,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    prog: str,
    description: str,
) -> T:
    """Build `cls` (a dataclass whose fields all have defaults and descriptions) from flags and
    `prefix`* variables. Bad values exit with status 2 and one line naming the flag, variable and
    value."""
    environ = os.environ if environ is None else environ
    declared = options(cls, prefix)
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for option in declared:
        text = describe(option)
        metavar = "{" + ",".join(option.choices) + "}" if option.choices else None
        if option.kind is bool:
            action: Any = argparse.BooleanOptionalAction
            parser.add_argument(option.flag, dest=option.name, action=action, default=None, help=text)
        elif option.kind is tuple:
            parser.add_argument(option.flag, dest=option.name, action="append", default=None, help=text)
        else:
            parser.add_argument(option.flag, dest=option.name, default=None, metavar=metavar, help=text)
    known = {option.env for option in declared}
    for name in sorted(environ):
        if name.startswith(prefix) and name not in known:
            print(f"{prog}: warning: unknown environment variable {name} (ignored)", file=sys.stderr)
    given = vars(parser.parse_args(argv))
    values = {}
    for option in declared:
        # The variable is checked even when a flag overrides it: a bad value is never silent.
        for source, raw in (
            (f"environment variable {option.env}", environ.get(option.env)),
            (f"argument {option.flag}", given[option.name]),
        ):
            if raw is None:
                continue
            try:
                values[option.name] = convert(option, raw)
            except ValueError as exc:
                other = f"env {option.env}" if source.startswith("argument") else f"flag {option.flag}"
                parser.exit(2, f"{prog}: error: {source}: {exc} ({other})\n")
    return cls(**values)


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 hosts in brackets) -> (host, port)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _listen_address(value: str) -> None:
    host, _, port = value.rpartition(":")
    if not host.strip("[]") or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"{value!r} is not HOST:PORT (port 0-65535; 0 picks a free port)")


def _listen_address_or_empty(value: str) -> None:
    if value:
        _listen_address(value)


# Declared on every address a process listens on: `Annotated[str, LISTEN, Meta(description=...)]`.
LISTEN = msgspec.Meta(extra={"check": _listen_address})
LISTEN_OR_EMPTY = msgspec.Meta(extra={"check": _listen_address_or_empty})  # empty: that listener is off
