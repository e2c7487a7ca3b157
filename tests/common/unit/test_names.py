"""The one rule for client-sent model names and versions, and the cap on echoed values."""

from __future__ import annotations

import pytest

from modelyard.common import names


@pytest.mark.parametrize("name", ["scaler", "codelm", "a", "A1", "m.v2", "my_model-3", "9" * 128])
def test_valid_names_pass(name: str) -> None:
    assert names.check_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "..",
        "../etc",
        "a/../b",
        "/abs",
        "a/b",
        "a\\b",
        "a\x00b",
        "-flag",
        ".hidden",
        "_x",
        "a..b",
        "x" * 129,
        "naïve",
        "sp ace",
        "new\nline",
    ],
)
def test_invalid_names_raise_naming_the_field(name: str) -> None:
    with pytest.raises(names.InvalidName) as raised:
        names.check_name(name, "model_name")
    assert raised.value.field == "model_name"
    assert str(raised.value).startswith("model_name ")
    assert len(str(raised.value)) < 300


def test_an_empty_version_means_none_asked_for() -> None:
    assert names.check_version("") == ""
    assert names.check_version("3") == "3"
    with pytest.raises(names.InvalidName):
        names.check_version("../1", "model_version")


def test_echo_caps_long_values_and_shows_control_characters() -> None:
    assert names.echo("x" * 1_000_000) == "'" + "x" * 128 + "...'"
    assert names.echo("a\x00b") == "'a\\x00b'"
    assert names.echo("short") == "'short'"
