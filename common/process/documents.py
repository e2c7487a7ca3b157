"""Typed configuration documents (a model's config.yaml, the sidecar's route file): one msgspec
declaration (Structs with `Annotated[int, Meta(ge=1, description=...)]` fields) gives the parsing,
the checks and the JSON Schema that editors validate the file with. `load` turns a failure into
one message naming the key path and the value, in the words of the declaration:

    execution.instances: expected an integer >= 1, got 0
    inputs[0] (x).shape[1]: expected an integer >= -1, got -2
    dynamic_batching: unknown key(s) priority (expected one of max_queue_delay_us, ...)

A `Meta(extra={"expects": "..."})` on a field replaces the generated "expected ..." words.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec

from modelyard.common.names import echo

T = TypeVar("T")

_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]|\[\.\.\.\]")


class DocumentError(ValueError):
    """A document does not match its declaration; `path` is the key path (`execution.instances`)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


def load(raw: object, kind: type[T], root: str, at: str | None = None) -> T:
    """`raw` (parsed YAML) as `kind`; DocumentError naming the key path otherwise. `root` names the
    document itself in messages (a path with no keys); `at`, where given, is the key path the
    document sits at (messages start from it)."""
    try:
        return msgspec.convert(raw, kind, strict=True)
    except msgspec.ValidationError as exc:
        raise _explain(str(exc), raw, kind, root, at) from None


def join(path: str, key: object, root: str) -> str:
    return str(key) if path == root else f"{path}.{key}"


def _explain(message: str, raw: object, kind: Any, root: str, start: str | None = None) -> DocumentError:
    """msgspec's `message` for `raw`, in the declaration's words at the key path `start`."""
    text, _, at = message.rpartition(" - at `")
    if not text:
        text, at = message, "$`"
    if at.startswith("key` in `"):  # a mapping's key has the wrong type
        at = at.removeprefix("key` in `")
        text = "key"
    path, value, declared = start or root, raw, kind
    for step in _STEP.finditer(at.rstrip("`")[1:]):
        field, index = step.group(1), step.group(2)
        declared = _container(declared)
        if field is not None:
            declared = _field_type(declared, field)
            value = value.get(field) if isinstance(value, dict) else None
            path = join(path, field, root)
        elif index is not None:
            declared = _item_type(declared)
            value = value[int(index)] if isinstance(value, list) and int(index) < len(value) else None
            path = f"{path}[{index}]"
            name = value.get("name") if isinstance(value, dict) else None
            if isinstance(name, str) and name:
                path += f" ({name})"
        else:  # a mapping's entry: find which one is wrong, and say why in its own words
            return _explain_entry(value, declared, path, root)
    if text == "key":
        return _explain_entry(value, _container(declared), path, root)
    if text.startswith("Object contains unknown field `"):
        unknown = text.removeprefix("Object contains unknown field `").rstrip("`")
        allowed = ", ".join(f.encode_name for f in msgspec.structs.fields(_container(declared)))
        return DocumentError(path, f"unknown key(s) {unknown} (expected one of {allowed})")
    if text.startswith("Object missing required field `"):
        missing = text.removeprefix("Object missing required field `").rstrip("`")
        return DocumentError(path, f"missing key {missing}")
    return DocumentError(path, f"expected {expects(declared)}, got {_shown(value)}")


def _explain_entry(value: object, declared: Any, path: str, root: str) -> DocumentError:
    key_type, value_type = typing.get_args(_strip(declared)) or (Any, Any)
    for key, item in (value or {}).items() if isinstance(value, dict) else ():
        try:
            msgspec.convert(key, key_type, strict=True)
        except msgspec.ValidationError:
            return DocumentError(path, f"key {key!r} is not {expects(key_type)}")
        try:
            msgspec.convert(item, value_type, strict=True)
        except msgspec.ValidationError as exc:
            return _explain(str(exc), item, value_type, root, join(path, key, root))
    return DocumentError(path, f"expected {expects(declared)}")


def _shown(value: object) -> str:
    if isinstance(value, dict | list):
        return type(value).__name__
    return echo(value) if isinstance(value, str) else repr(value)


def _strip(kind: Any) -> Any:
    """The type without its Annotated metadata."""
    while typing.get_origin(kind) is typing.Annotated:
        kind = typing.get_args(kind)[0]
    return kind


def _metas(kind: Any) -> list[msgspec.Meta]:
    found = []
    while typing.get_origin(kind) is typing.Annotated:
        kind, *extras = typing.get_args(kind)
        found += [m for m in extras if isinstance(m, msgspec.Meta)]
    return found


def _members(kind: Any) -> tuple[Any, ...]:
    """The members of a union that a document can hold (not None, not UNSET)."""
    kind = _strip(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return tuple(m for m in typing.get_args(kind) if m not in (type(None), msgspec.UnsetType))
    return (kind,)


def _container(kind: Any) -> Any:
    """The Struct, list or dict type among a union's members (what a path step walks into)."""
    members = _members(kind)
    for member in members:
        bare = _strip(member)
        if (isinstance(bare, type) and issubclass(bare, msgspec.Struct)) or typing.get_origin(bare) in (
            list,
            tuple,
            dict,
        ):
            return member
    return members[0] if members else kind


def _field_type(kind: Any, name: str) -> Any:
    bare = _strip(kind)
    if isinstance(bare, type) and issubclass(bare, msgspec.Struct):
        for info in msgspec.structs.fields(bare):
            if info.encode_name == name:
                return info.type
    return Any


def _item_type(kind: Any) -> Any:
    args = typing.get_args(_strip(kind))
    return args[0] if args else Any


_NOUNS = {int: ("an integer", "integers"), float: ("a number", "numbers"), str: ("a string", "strings")}


def expects(kind: Any, plural: bool = False) -> str:
    """A declared type in words: "an integer >= 1", "one of fail, drain_first", "a mapping"."""
    metas = _metas(kind)
    for meta in metas:
        if meta.extra and "expects" in meta.extra:
            return str(meta.extra["expects"])
    members = _members(kind)
    if len(members) != 1:
        return " or ".join(expects(m, plural) for m in members)
    if members[0] is not _strip(kind):  # X | None, X | UNSET: what X must be
        return expects(members[0], plural)
    bare = members[0]
    origin = typing.get_origin(bare)
    limits = bounds(metas)
    if origin is typing.Literal:
        return "one of " + ", ".join(str(v) for v in typing.get_args(bare))
    if origin in (list, tuple):
        item = typing.get_args(bare)[0] if typing.get_args(bare) else Any
        sized = "non-empty " if any(m.min_length for m in metas) else ""
        return f"a {sized}list of {expects(item, plural=True)}"
    if origin is dict or (isinstance(bare, type) and issubclass(bare, msgspec.Struct)):
        return "mappings" if plural else "a mapping"
    if bare is bool:
        return "true or false"
    one, many = _NOUNS.get(bare, ("a value", "values"))
    if bare is str and any(m.min_length for m in metas):
        one, many = "a non-empty string", "non-empty strings"
    return f"{many if plural else one} {limits}".strip()


def bounds(metas: Sequence[msgspec.Meta]) -> str:
    """A declaration's numeric constraints in words: ">= 0", ">= 0, <= 65535"."""
    parts = []
    for meta in metas:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            limit = getattr(meta, attr)
            if limit is not None:
                parts.append(f"{sign} {limit:g}")
    return ", ".join(parts)
