"""Config parsing and repository scanning: no sockets, no sessions."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelyard.service.repository.model_config import (
    ConfigError,
    ModelConfig,
    VersionPolicy,
    load_config,
    parse_config,
)
from modelyard.service.repository.scanner import scan_model, scan_repository
from modelyard.service.settings import parse_settings
from modelyard.service.versions import parse_version


def test_full_config_parses() -> None:
    config = parse_config(
        {
            "max_batch_size": 32,
            "version_policy": {"specific": [1, 3]},
            "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 256]}],
            "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 16]}],
            "execution": {
                "provider": "cuda",
                "device_id": 1,
                "gpu_mem_limit_mb": 512,
                "intra_op_threads": 2,
                "inter_op_threads": 1,
            },
            "dynamic_batching": {"max_queue_delay_us": 2000, "preferred_batch_sizes": [8, 16]},
        }
    )
    assert config.max_batch_size == 32
    assert config.version_policy == VersionPolicy("specific", versions=(1, 3))
    assert config.inputs[0].shape == (-1, 256) and config.outputs[0].name == "OUTPUT0"
    assert config.execution.provider == "cuda" and config.execution.gpu_mem_limit_mb == 512
    assert config.dynamic_batching is not None and config.dynamic_batching.preferred_batch_sizes == (8, 16)


def test_defaults_without_a_config_file(tmp_path: Path) -> None:
    config = load_config(tmp_path)
    assert config == ModelConfig()
    assert config.version_policy == VersionPolicy("latest", latest=1)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"max_batchsize": 3}, "unknown key(s) max_batchsize"),
        ({"max_batch_size": -1}, "max_batch_size"),
        ({"max_batch_size": True}, "max_batch_size"),
        ({"version_policy": {"latest": 0}}, "version_policy.latest"),
        ({"version_policy": {"latest": 1, "all": {}}}, "exactly one"),
        ({"version_policy": {"newest": 1}}, "unknown key(s) newest (expected one of latest, specific, all)"),
        ({"version_policy": {"specific": []}}, "non-empty"),
        ({"inputs": [{"name": "x", "datatype": "FLOAT", "shape": [1]}]}, "unknown datatype 'FLOAT'"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [-2]}]}, "shape"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}] * 2}, "duplicate"),
        ({"execution": {"provider": "tpu"}}, "execution.provider"),
        ({"dynamic_batching": {"max_queue_delay_us": 1, "priority": 2}}, "unknown key(s) priority"),
        ([1, 2], "expected a mapping"),
        ({"limits": {"max_elements": 0}}, "limits.max_elements"),
        ({"limits": {"max_bytes": 1}}, "unknown key(s) max_bytes"),
    ],
)
def test_bad_configs_name_the_key(raw: object, words: str) -> None:
    with pytest.raises(ConfigError, match=None) as caught:
        parse_config(raw)
    assert words in str(caught.value)


def test_bad_yaml_names_the_file_relative_and_quotes_nothing(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("max_batch_size: 1\nsecret-value: [ {")
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path)
    message = str(caught.value)
    assert message.startswith(f"{tmp_path.name}/config.yaml: not valid YAML (line ")
    assert str(tmp_path) not in message and "secret" not in message


def test_config_resolving_outside_the_repository_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("password: hunter2 [\n")
    root = tmp_path / "models"
    (root / "m").mkdir(parents=True)
    (root / "m" / "config.yaml").symlink_to(secret)
    with pytest.raises(ConfigError) as caught:
        load_config(root / "m", root)
    assert str(caught.value) == "m/config.yaml: resolves outside the model repository"


@pytest.mark.parametrize(
    ("policy", "available", "served"),
    [
        (VersionPolicy("latest", latest=1), [3, 1, 2], [3]),
        (VersionPolicy("latest", latest=2), [3, 1, 2], [2, 3]),
        (VersionPolicy("specific", versions=(1, 3, 7)), [1, 2, 3], [1, 3]),
        (VersionPolicy("all"), [2, 10, 1], [1, 2, 10]),
    ],
)
def test_version_policies(policy: VersionPolicy, available: list[int], served: list[int]) -> None:
    assert policy.select(available) == served


def test_version_folder_names() -> None:
    assert parse_version("3") == 3 and parse_version("v12") == 12 and parse_version("007") == 7
    assert parse_version("latest") is None and parse_version("v") is None and parse_version("-1") is None
    assert parse_version("1\n") is None  # a `$` in the pattern let a trailing newline through


def _touch_model(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(b"x")


def test_scanner_finds_versions_and_problems(tmp_path: Path) -> None:
    _touch_model(tmp_path / "a" / "1")
    _touch_model(tmp_path / "a" / "v2")
    (tmp_path / "a" / "3").mkdir()  # half-published: no model.onnx yet
    (tmp_path / "a" / "notes").mkdir()
    _touch_model(tmp_path / "b" / "1")
    _touch_model(tmp_path / "b" / "v1")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "README").write_text("not a model")
    models = scan_repository(tmp_path)
    assert sorted(models) == ["a", "b"]
    assert sorted(models["a"].versions) == [1, 2] and not models["a"].problems
    assert sorted(models["b"].versions) == [1] and "present twice" in models["b"].problems[0]


def test_scanner_refuses_bad_names(tmp_path: Path) -> None:
    from modelyard.service.errors import ModelLoadError

    for name in ("../etc", "a/b", ".hidden", "", "a..b", "a\n", "x" * 129):
        with pytest.raises(ModelLoadError):
            scan_model(tmp_path, name)


def test_scanner_skips_and_reports_folders_with_bad_names(tmp_path: Path) -> None:
    for name in ("good", "bad name", "a..b", ".hidden"):
        _touch_model(tmp_path / name / "1")
    skipped: set[str] = set()
    assert sorted(scan_repository(tmp_path, skipped)) == ["good"]
    assert skipped == {"bad name", "a..b"}  # hidden folders are not models, and not news


def test_settings_from_flags_and_environment() -> None:
    env = {"MODELYARD_SERVICE_LISTEN": "127.0.0.1:6000", "MODELYARD_SERVICE_GRACE_S": "2.5"}
    settings = parse_settings(["--repository", "/tmp/r", "--metrics-listen", ""], env)
    assert str(settings.repository) == "/tmp/r" and settings.listen == "127.0.0.1:6000"
    assert settings.grace_s == 2.5 and settings.metrics_listen == ""
    assert parse_settings(["--listen", "127.0.0.1:7000"], env).listen == "127.0.0.1:7000"
    defaults = parse_settings([], {})
    assert defaults.listen == "127.0.0.1:50052" and defaults.metrics_listen == "127.0.0.1:9102"
