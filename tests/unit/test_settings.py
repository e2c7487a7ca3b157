"""modelyard.common.settings: flags over environment over defaults, for any process's dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from modelyard.common.settings import parse_bool, parse_settings, split_address


@dataclass(frozen=True)
class Example:
    name: str = "a"
    count: int = 1
    ratio: float = 0.5
    root: Path = Path("models")
    enabled: bool = True
    upstream: tuple[str, ...] = ("127.0.0.1:1",)


HELP = {f: f for f in ("name", "count", "ratio", "root", "enabled", "upstream")}


def parse(argv: list[str], env: dict[str, str]) -> Example:
    return parse_settings(Example, "MODELYARD_TEST_", argv, env, prog="t", description="t", help=HELP)


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
    with pytest.raises(SystemExit) as caught:
        parse([], {"MODELYARD_TEST_ENABLED": "maybe"})
    assert caught.value.code == 2
    assert "MODELYARD_TEST_ENABLED" in capsys.readouterr().err


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


def test_addresses() -> None:
    assert split_address("127.0.0.1:50052") == ("127.0.0.1", 50052)
    assert split_address("[::1]:0") == ("::1", 0)
    for bad in ("50052", "host:", ":1", "host:port"):
        with pytest.raises(ValueError):
            split_address(bad)
