"""Triton load parameters: the config JSON mapped onto our config, and uploaded file paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelyard.kserve.v2.grpc_service_pb2 import ModelRepositoryParameter
from modelyard.service.api.kserve.triton_config import load_parameters, parse_triton_config
from modelyard.service.errors import InvalidInput, TooLarge
from modelyard.service.repository.model_config import TensorConfig
from modelyard.service.repository.uploads import UploadSpace, check_paths, write_upload


def test_full_triton_config_maps_onto_ours() -> None:
    text = json.dumps(
        {
            "name": "m",
            "platform": "onnxruntime_onnx",
            "max_batch_size": 8,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
            "output": [{"name": "y", "data_type": "TYPE_STRING", "dims": [-1], "label_filename": "l.txt"}],
            "version_policy": {"specific": {"versions": [1, 3]}},
            "dynamic_batching": {"max_queue_delay_microseconds": 500, "preferred_batch_size": [4, 8]},
            "instance_group": [{"kind": "KIND_CPU", "count": 1}],
        }
    )
    config = parse_triton_config(text, "m")
    assert config.max_batch_size == 8
    assert config.inputs == (TensorConfig("x", "FP32", (-1, 4)),)
    assert config.outputs == (TensorConfig("y", "BYTES", (-1, -1), "l.txt"),)
    assert (config.version_policy.kind, config.version_policy.versions) == ("specific", (1, 3))
    assert config.dynamic_batching is not None
    assert config.dynamic_batching.max_queue_delay_us == 500
    assert config.dynamic_batching.preferred_batch_sizes == (4, 8)
    assert config.execution.provider == "cpu"


def test_input_format_and_model_warmup_map_onto_ours() -> None:
    text = json.dumps(
        {
            "max_batch_size": 4,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [8, 8, 3], "format": "FORMAT_NHWC"}],
            "model_warmup": [
                {
                    "name": "w",
                    "batch_size": 2,
                    "count": 3,
                    "inputs": {"x": {"data_type": "TYPE_FP32", "dims": [8, 8, 3], "random_data": True}},
                }
            ],
        }
    )
    config = parse_triton_config(text, "m")
    assert config.inputs == (TensorConfig("x", "FP32", (-1, 8, 8, 3), format="FORMAT_NHWC"),)
    (sample,) = config.model_warmup
    assert (sample.name, sample.batch_size, sample.count) == ("w", 2, 3)
    assert sample.inputs[0][0] == "x" and sample.inputs[0][1].source == "random"
    with pytest.raises(InvalidInput, match=r"FORMAT_NCHW needs 3 dimensions beside the batch's"):
        parse_triton_config(
            '{"max_batch_size": 4, "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [8, 8], '
            '"format": "FORMAT_NCHW"}]}',
            "m",
        )


def test_an_ensemble_maps_onto_ours() -> None:
    text = json.dumps(
        {
            "platform": "ensemble",
            "max_batch_size": 2,
            "input": [{"name": "IN", "data_type": "TYPE_STRING", "dims": [1]}],
            "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]}],
            "ensemble_scheduling": {
                "step": [
                    {
                        "model_name": "a",
                        "model_version": -1,
                        "input_map": {"x": "IN"},
                        "output_map": {"y": "mid"},
                    },
                    {
                        "model_name": "b",
                        "model_version": 3,
                        "input_map": {"x": "mid"},
                        "output_map": {"y": "OUT"},
                    },
                ]
            },
        }
    )
    config = parse_triton_config(text, "e")
    assert config.platform == "ensemble" and config.ensemble is not None
    assert [(s.model, s.version, s.inputs, s.outputs) for s in config.ensemble.steps] == [
        ("a", -1, (("x", "IN"),), (("y", "mid"),)),
        ("b", 3, (("x", "mid"),), (("y", "OUT"),)),
    ]


def test_instance_group_maps_onto_instances_per_device() -> None:
    gpus = parse_triton_config('{"instance_group": [{"kind": "KIND_GPU", "count": 2, "gpus": [0, 1]}]}', "m")
    assert (gpus.execution.provider, gpus.execution.instances, gpus.execution.device_ids) == (
        "cuda",
        2,
        (0, 1),
    )
    assert gpus.execution.sessions == 4  # count on each GPU listed, as Triton places them
    assert gpus.execution.device_id == 0
    cpu = parse_triton_config('{"instance_group": [{"kind": "KIND_CPU", "count": 3}]}', "m").execution
    assert (cpu.provider, cpu.instances, cpu.device_ids, cpu.sessions) == ("cpu", 3, (), 3)
    one = parse_triton_config('{"instance_group": [{"kind": "KIND_GPU", "gpus": [2]}]}', "m").execution
    assert (one.instances, one.device_id, one.devices) == (1, 2, (2,))  # count 0: Triton's default, 1


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("{", "not a Triton model configuration"),
        ('{"max_batch_size": "x"}', "max_batch_size"),
        ('{"nonsense": 1}', "nonsense"),
        ('{"ensemble_scheduling": {}}', "ensemble_scheduling"),
        ('{"name": "other"}', "other"),
        ('{"backend": "pytorch"}', "pytorch"),
        ('{"dynamic_batching": {"preserve_ordering": true}, "max_batch_size": 2}', "preserve_ordering"),
        ('{"dynamic_batching": {}}', "max_batch_size"),
        ('{"instance_group": [{"count": 99}]}', "execution.instances: 99"),
        ('{"instance_group": [{"count": 2, "kind": "KIND_CPU", "gpus": [0]}]}', "KIND_CPU places nothing"),
        ('{"instance_group": [{"kind": "KIND_GPU", "gpus": [1, 1]}]}', "names a device twice"),
        ('{"instance_group": [{"kind": "KIND_CPU"}, {"kind": "KIND_GPU"}]}', "one group only"),
        (
            '{"max_batch_size": 2, "dynamic_batching": '
            '{"default_queue_policy": {"timeout_action": "DELAY"}}}',
            "only REJECT",
        ),
        ('{"input": [{"name": "x", "dims": [1]}]}', "data_type"),
    ],
)
def test_refused_configs_name_the_problem(text: str, named: str) -> None:
    with pytest.raises(InvalidInput, match=named):
        parse_triton_config(text, "m")


def param(**kwargs: object) -> ModelRepositoryParameter:
    return ModelRepositoryParameter(**kwargs)  # type: ignore[arg-type]


def test_load_parameters_refuse_unknown_keys_and_files_without_config() -> None:
    with pytest.raises(InvalidInput, match="'poll'"):
        load_parameters("m", {"poll": param(bool_param=True)})
    with pytest.raises(InvalidInput, match="'config' parameter as well"):
        load_parameters("m", {"file:1/model.onnx": param(bytes_param=b"x")})
    with pytest.raises(InvalidInput, match="must be a string"):
        load_parameters("m", {"config": param(bytes_param=b"{}")})
    assert load_parameters("m", {}).config is None


@pytest.mark.parametrize(
    "path",
    [
        "../1/model.onnx",
        "/1/model.onnx",
        "1/../../x",
        "1//model.onnx",
        ".hidden",
        "x/model.onnx",
        "config.yaml",
        "1/model.onnx\n",
        "1/a\x00b",
        "1/..",
        "",
    ],
)
def test_unsafe_paths_are_refused(path: str) -> None:
    with pytest.raises(InvalidInput):
        check_paths({path: b"", "1/model.onnx": b""})


def test_upload_is_private_and_laid_out_as_a_repository(tmp_path: Path) -> None:
    upload = write_upload(tmp_path, "m", {"1/model.onnx": b"abc", "labels.txt": b"a\nb\n"})
    assert upload.root.parent == tmp_path
    assert (upload.root.stat().st_mode & 0o777) == 0o700
    assert (upload.root / "m" / "1" / "model.onnx").read_bytes() == b"abc"
    assert (upload.root / "m" / "labels.txt").read_bytes() == b"a\nb\n"
    upload.remove()
    assert not upload.root.exists()


def test_uploads_share_a_bounded_space_and_give_it_back_once(tmp_path: Path) -> None:
    space = UploadSpace(limit=10)
    first = write_upload(tmp_path, "a", {"1/model.onnx": b"123456"}, space)
    assert space.used == 6
    with pytest.raises(TooLarge, match="--max-upload-bytes"):
        write_upload(tmp_path, "b", {"1/model.onnx": b"12345"}, space)
    assert [p.name for p in tmp_path.iterdir()] == [first.root.name]  # nothing written for b
    first.remove()
    first.remove()
    assert space.used == 0 and not first.root.exists()
    write_upload(tmp_path, "b", {"1/model.onnx": b"1234567890"}, space).remove()
    assert space.used == 0
    unlimited = UploadSpace(limit=0)
    write_upload(tmp_path, "c", {"1/model.onnx": b"x" * 100}, unlimited).remove()


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "/abs", "a/b", "a\x00b", "x" * 129])
def test_upload_names_that_are_no_folder_name_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(InvalidInput, match="model_name"):
        write_upload(tmp_path, name, {"1/model.onnx": b"abc"})
    assert list(tmp_path.iterdir()) == []  # not even the private folder was made
