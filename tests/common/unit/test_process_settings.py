"""Each process's settings through the one validation: the variables pass the flags' checks,
negative limits are refused, unknown variables with the prefix are warned about."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from modelyard.deploy.up import parse_settings as up_settings
from modelyard.gateway.settings import parse_settings as gateway_settings
from modelyard.service.settings import parse_settings as service_settings
from modelyard.sidecar.settings import parse_settings as sidecar_settings

Parse = Callable[[Sequence[str] | None, Mapping[str, str] | None], Any]
PROCESSES: list[tuple[Parse, str]] = [
    (service_settings, "MODELYARD_SERVICE_"),
    (sidecar_settings, "MODELYARD_SIDECAR_"),
    (gateway_settings, "MODELYARD_GATEWAY_"),
]


def exit_line(parse: Parse, argv: list[str], env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as caught:
        parse(argv, env)
    assert caught.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("parse", "prefix"), PROCESSES)
def test_a_bad_log_level_in_the_environment_is_one_line_naming_the_variable(
    parse: Parse, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = exit_line(parse, [], {prefix + "LOG_LEVEL": "LOUD"}, capsys)
    assert f"environment variable {prefix}LOG_LEVEL: 'LOUD' is not one of DEBUG, INFO, WARNING, ERROR" in err
    assert err.count("\n") == 1
    assert "'xml' is not one of text, json" in exit_line(parse, [], {prefix + "LOG_FORMAT": "xml"}, capsys)


@pytest.mark.parametrize(("parse", "prefix"), PROCESSES)
def test_log_levels_read_the_same_from_flags_and_variables(parse: Parse, prefix: str) -> None:
    assert parse(["--log-level", "debug"], {}).log_level == "DEBUG"
    assert parse([], {prefix + "LOG_LEVEL": "debug"}).log_level == "DEBUG"
    assert parse([], {prefix + "LOG_FORMAT": "JSON"}).log_format == "json"


@pytest.mark.parametrize(("parse", "prefix"), PROCESSES)
def test_negative_limits_are_refused(parse: Parse, prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert "'-1' is not a number >= 0" in exit_line(parse, ["--grace-s", "-1"], {}, capsys)
    assert "'-5' is not a number >= 0" in exit_line(parse, [], {prefix + "GRACE_S": "-5"}, capsys)


def test_the_limits_each_process_names() -> None:
    for argv, parse in (
        (["--max-streams", "-1"], gateway_settings),
        (["--grpc-max-concurrent-streams", "0"], service_settings),
        (["--admin-max-connections", "0"], sidecar_settings),
        (["--config-poll-s", "0"], sidecar_settings),
        (["--envoy-port", "65536"], up_settings),
    ):
        with pytest.raises(SystemExit) as caught:
            parse(argv, {})
        assert caught.value.code == 2, argv


@pytest.mark.parametrize(("parse", "prefix"), PROCESSES)
def test_a_misspelt_variable_is_warned_about(
    parse: Parse, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parse([], {prefix + "GRACE": "3", prefix + "GRACE_S": "3"})
    assert capsys.readouterr().err.strip().endswith(f"unknown environment variable {prefix}GRACE (ignored)")
