"""The fleet rollout controller's command line (sidecar/fleet/cli.py) and `modelyard canary
--controller` (sidecar/rollout/canary_cli.py): usage mistakes are one line and exit 2, before anything
starts; the sidecars named by DNS are each address's admin URL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from modelyard.sidecar.fleet.cli import main
from modelyard.sidecar.fleet.pods import from_dns
from modelyard.sidecar.rollout import canary_cli as rollout_cli


def test_a_controller_needs_its_sidecars(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--prometheus", "http://127.0.0.1:9090"]) == 2
    err = capsys.readouterr().err
    assert "argument --sidecar: name the sidecars" in err and "MODELYARD_ROLLOUTS_SIDECAR" in err


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--tick-s", "0"], "argument --tick-s"),
        (["--lease-s", "601"], "argument --lease-s"),
        (["--lease-s", "2", "--tick-s", "1"], "under 3 ticks"),
        (["--state-file", "x", "--kubernetes-state", "y"], "not both"),
        (["--listen", "nonsense"], "argument --listen"),
    ],
)
def test_bad_settings_are_one_line_and_exit_2(
    flags: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["--sidecar", "http://127.0.0.1:9101", *flags])
    except SystemExit as exited:  # a value its declaration refuses (the settings parser)
        code = int(str(exited.code))
    assert code == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_the_environment_sets_it_too() -> None:
    from modelyard.sidecar.fleet.settings import parse_settings

    settings = parse_settings([], {"MODELYARD_ROLLOUTS_SIDECAR": "http://a:9101,http://b:9101"})
    assert settings.sidecar == ("http://a:9101", "http://b:9101")


def test_a_state_file_that_is_not_the_state_stops_it_at_start(tmp_path: Path) -> None:
    state = tmp_path / "rollouts.json"
    state.write_text('{"format": 1, "rollouts": {"scaler": {"state": "nonsense"}}}')
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "modelyard.rollouts",
            "--sidecar",
            "http://127.0.0.1:9",
            "--state-file",
            str(state),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "modelyard rollouts: error: state file" in done.stderr and "scaler" in done.stderr


def test_a_queries_file_with_an_unknown_key_stops_it_at_start(tmp_path: Path) -> None:
    queries = tmp_path / "q.yaml"
    queries.write_text("nonsense: 1\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "modelyard.rollouts",
            "--sidecar",
            "http://127.0.0.1:9",
            "--queries",
            str(queries),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "unknown key(s) nonsense" in done.stderr


def test_the_dns_names_sidecars_by_address() -> None:
    assert "http://127.0.0.1:9101" in from_dns("localhost")
    assert "http://127.0.0.1:9200" in from_dns("localhost:9200")


def test_canary_controller_takes_the_rollout_verbs_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        rollout_cli.main(["--controller", "http://127.0.0.1:9", "set", "scaler", "5"])
    assert exited.value.code == 2 and "--controller takes the rollout verbs only" in capsys.readouterr().err
    # A rollout verb goes to the controller's URL (nothing listens: no answer, exit 2, named).
    assert rollout_cli.main(["--controller", "http://127.0.0.1:9", "rollout", "status", "scaler"]) == 2
    assert "no answer from http://127.0.0.1:9" in capsys.readouterr().err
