"""modelyard.process.documents: a typed declaration checks a parsed document and says what is
wrong at which key path, in the declaration's words."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import pytest
from msgspec import UNSET, Meta, UnsetType

from modelyard.process.documents import DocumentError, load


class Level(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    size: Annotated[int, Meta(ge=0)] = 0


class Item(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, Meta(min_length=1)]
    dims: list[Annotated[int, Meta(ge=-1)]] = msgspec.field(default_factory=list)
    file: Annotated[str, Meta(pattern="^[a-z]*$", extra={"expects": "a plain file name"})] = ""


class Doc(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    count: Annotated[int, Meta(ge=1)] = 1
    ratio: float = 0.5
    mode: Literal["a", "b"] = "a"
    flag: bool = False
    seed: Annotated[int, Meta(ge=0)] | UnsetType = UNSET
    items: list[Item] = msgspec.field(default_factory=list)
    levels: dict[int, Level] = msgspec.field(default_factory=dict)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"count": 0}, "count: expected an integer >= 1, got 0"),
        ({"count": True}, "count: expected an integer >= 1, got True"),
        ({"ratio": "x"}, "ratio: expected a number, got 'x'"),
        ({"mode": "c"}, "mode: expected one of a, b, got 'c'"),
        ({"flag": "yes"}, "flag: expected true or false, got 'yes'"),
        ({"seed": -1}, "seed: expected an integer >= 0, got -1"),
        (
            {"cuont": 1},
            "config: unknown key(s) cuont (expected one of count, ratio, mode, flag, seed, items, levels)",
        ),
        (
            {"items": [{"name": "x", "dims": [1, -2]}]},
            "items[0] (x).dims[1]: expected an integer >= -1, got -2",
        ),
        ({"items": [{"dims": []}]}, "items[0]: missing key name"),
        (
            {"items": [{"name": "x", "file": "../a"}]},
            "items[0] (x).file: expected a plain file name, got '../a'",
        ),
        ({"items": {}}, "items: expected a list of mappings, got dict"),
        ({"levels": {"high": {}}}, "levels: key 'high' is not an integer"),
        ({"levels": {1: {}, 2: {"size": -1}}}, "levels.2.size: expected an integer >= 0, got -1"),
        ([1], "config: expected a mapping, got list"),
    ],
)
def test_a_wrong_document_is_one_message_naming_the_key_path(raw: object, message: str) -> None:
    with pytest.raises(DocumentError) as caught:
        load(raw, Doc, "config")
    assert str(caught.value) == message


def test_a_good_document_is_typed() -> None:
    doc = load({"count": 3, "ratio": 2, "levels": {1: {"size": 4}}}, Doc, "config")
    assert doc.count == 3 and doc.ratio == 2.0 and doc.levels[1].size == 4 and doc.seed is UNSET


def test_long_values_are_capped_in_messages() -> None:
    with pytest.raises(DocumentError) as caught:
        load({"mode": "x" * 1000}, Doc, "config")
    assert len(str(caught.value)) < 200
