"""modelyard.process.settings: flags over environment over defaults, for any process's dataclass;
one declaration per setting, one validation for flags and variables."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import pytest
from msgspec import Meta

from modelyard.process.settings import options, parse_bool, parse_settings, split_address


@dataclass(frozen=True)
class Example:
    name: Annotated[str, Meta(description="a name")] = "a"
    count: Annotated[int, Meta(ge=0, description="how many")] = 1
    ratio: Annotated[float, Meta(gt=0, description="a ratio")] = 0.5
    root: Annotated[Path, Meta(description="a folder")] = Path("models")
    enabled: Annotated[bool, Meta(description="on or off")] = True
    upstream: Annotated[tuple[str, ...], Meta(description="addresses")] = ("127.0.0.1:1",)
    level: Annotated[Literal["DEBUG", "INFO"], Meta(description="log level")] = "INFO"


def parse(argv: list[str], env: dict[str, str]) -> Example:
    return parse_settings(Example, "MODELYARD_TEST_", argv, env, prog="t", description="t")


def refused(argv: list[str], env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as caught:
        parse(argv, env)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no usage dump
    return err


@pytest.mark.parametrize(
    ("text", "value"),
    [
        *[("false", False), ("False", False), ("0", False), ("no", False), ("off", False)],
        *[("true", True), ("TRUE", True), ("1", True), ("yes", True), (" on ", True)],
    ],
)
def test_booleans_from_the_environment_mean_what_they_say(text: str, value: bool) -> None:
    assert parse_bool(text) is value
    assert parse([], {"MODELYARD_TEST_ENABLED": text}).enabled is value


def test_a_bad_boolean_names_the_variable_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert "MODELYARD_TEST_ENABLED" in refused([], {"MODELYARD_TEST_ENABLED": "maybe"}, capsys)


def test_flags_override_environment_override_defaults() -> None:
    assert parse([], {}) == Example()
    env = {"MODELYARD_TEST_COUNT": "7", "MODELYARD_TEST_ENABLED": "false", "MODELYARD_TEST_RATIO": "2"}
    from_env = parse([], env)
    assert (from_env.count, from_env.enabled, from_env.ratio) == (7, False, 2.0)
    flags = parse(["--count", "9", "--enabled", "--root", "/r"], env)
    assert (flags.count, flags.enabled, flags.root) == (9, True, Path("/r"))
    assert parse(["--no-enabled"], {}).enabled is False


def test_repeatable_flags_and_comma_separated_variables() -> None:
    assert parse([], {"MODELYARD_TEST_UPSTREAM": "a:1, b:2"}).upstream == ("a:1", "b:2")
    flags = parse(["--upstream", "c:3", "--upstream", "d:4"], {"MODELYARD_TEST_UPSTREAM": "a:1"})
    assert flags.upstream == ("c:3", "d:4")


def test_flags_and_variables_pass_the_same_checks(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["--count", "-1"], {}, capsys)
    assert "argument --count: '-1' is not an integer >= 0" in err and "MODELYARD_TEST_COUNT" in err
    err = refused([], {"MODELYARD_TEST_COUNT": "-1"}, capsys)
    assert (
        "environment variable MODELYARD_TEST_COUNT: '-1' is not an integer >= 0" in err and "--count" in err
    )
    assert "'x' is not an integer" in refused([], {"MODELYARD_TEST_COUNT": "x"}, capsys)
    assert "'0' is not a number > 0" in refused(["--ratio", "0"], {}, capsys)
    # A bad variable is refused even when a flag overrides it: never silently wrong.
    assert "MODELYARD_TEST_COUNT" in refused(["--count", "3"], {"MODELYARD_TEST_COUNT": "x"}, capsys)


def test_allowed_values_match_in_any_case_from_flags_and_variables(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse(["--level", "debug"], {}).level == "DEBUG"
    assert parse([], {"MODELYARD_TEST_LEVEL": "Debug"}).level == "DEBUG"
    err = refused([], {"MODELYARD_TEST_LEVEL": "LOUD"}, capsys)
    assert "MODELYARD_TEST_LEVEL: 'LOUD' is not one of DEBUG, INFO" in err
    assert "'loud' is not one of DEBUG, INFO" in refused(["--level", "loud"], {}, capsys)


def test_help_shows_allowed_values_bounds_variables_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--help"], {})
    out = " ".join(capsys.readouterr().out.split())
    assert "--level {DEBUG,INFO}" in out
    assert "how many (>= 0; env MODELYARD_TEST_COUNT; default 1)" in out


def test_unknown_variables_with_the_prefix_are_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    parse([], {"MODELYARD_TEST_COUNTT": "3", "MODELYARD_TEST_COUNT": "3", "OTHER_COUNT": "3"})
    err = capsys.readouterr().err
    assert err == "t: warning: unknown environment variable MODELYARD_TEST_COUNTT (ignored)\n"


def test_every_setting_needs_a_default_and_a_description() -> None:
    @dataclass(frozen=True)
    class Bare:
        count: int = 1

    with pytest.raises(TypeError, match="description"):
        options(Bare, "X_")
    assert [o.env for o in options(Example, "MODELYARD_TEST_")][:2] == [
        "MODELYARD_TEST_NAME",
        "MODELYARD_TEST_COUNT",
    ]


def test_addresses() -> None:
    assert split_address("127.0.0.1:50052") == ("127.0.0.1", 50052)
    assert split_address("[::1]:0") == ("::1", 0)
    for bad in ("50052", "host:", ":1", "host:port"):
        with pytest.raises(ValueError):
            split_address(bad)
