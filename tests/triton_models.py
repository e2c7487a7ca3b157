"""ONNX stand-ins for the models Triton's example clients expect (its docs/examples repository and
qa/ models), built with onnx.helper: the same names, tensors, datatypes and shapes as Triton's
configs, so that the example clients run unchanged against them.

- `simple`: INPUT0, INPUT1 INT32 [-1, 16] -> OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1
- `simple_string`: the same on BYTES holding decimal numbers (Cast string -> INT32, add and
  subtract, Cast back): a model that a synthetic warm-up ("" elements) cannot run
- `image_preprocess`: BYTES [-1, 1] holding a plain PPM image (P3: ASCII numbers, one space
  apart) -> FP32
  [-1, H, W, 3] scaled to [0, 1]; the first step of the ensemble `preprocess_inception_ensemble`
- `image_classifier`: FP32 [-1, H, W, 3] (FORMAT_NHWC) -> FP32 [-1, CLASSES], a dense layer over
  the image's mean colour, for image_client.py; `labels` name its classes
- `simple_int8`, `simple_identity` (BYTES), and `densenet_onnx`'s tensors for grpc_client.py
- `custom_identity_int32`: INT32 [-1, 16] -> the same (Triton's custom identity backend, which
  memory_growth_test.py calls)

ONNX Runtime has no image decoder (ai.onnx ImageDecoder has no kernel in 1.31), so the ensemble's
images are PPM text, which ONNX's string ops can read; a PNG's bytes reach a model only as BYTES.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from models.demo_models import make_model, write_model

SIDE = 4  # the image models' height and width
CLASSES = ["red", "green", "blue", "grey"]
MAX_BATCH = 8


def _io(name: str, elem: int, shape: list[Any]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def simple() -> onnx.ModelProto:
    shape: list[Any] = ["batch", 16]
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "simple",
        [_io("INPUT0", TensorProto.INT32, shape), _io("INPUT1", TensorProto.INT32, shape)],
        [_io("OUTPUT0", TensorProto.INT32, shape), _io("OUTPUT1", TensorProto.INT32, shape)],
    )
    return make_model(graph, "Triton's simple: sum and difference")


def simple_int8() -> onnx.ModelProto:
    """simple on INT8 (grpc_explicit_int8_content_client.py)."""
    model = simple()
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.elem_type = TensorProto.INT8
    onnx.checker.check_model(model, full_check=True)
    return model


def simple_identity() -> onnx.ModelProto:
    """INPUT0 BYTES [-1, -1] -> OUTPUT0, the same (simple_*_string_infer_client.py)."""
    shape: list[Any] = ["batch", "n"]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        "simple_identity",
        [_io("INPUT0", TensorProto.STRING, shape)],
        [_io("OUTPUT0", TensorProto.STRING, shape)],
    )
    return make_model(graph, "Triton's simple_identity")


def custom_identity_int32() -> onnx.ModelProto:
    """INPUT0 INT32 [-1, 16] -> OUTPUT0, the same (memory_growth_test.py)."""
    shape: list[Any] = ["batch", 16]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        "custom_identity_int32",
        [_io("INPUT0", TensorProto.INT32, shape)],
        [_io("OUTPUT0", TensorProto.INT32, shape)],
    )
    return make_model(graph, "Triton's custom_identity_int32")


def densenet_stand_in() -> onnx.ModelProto:
    """densenet_onnx's tensors (data_0 FP32 [3, 224, 224] -> fc6_1 FP32 [1000, 1, 1]), not its
    network: grpc_client.py only sends and prints."""
    nodes = [
        helper.make_node("ReduceMean", ["data_0", "axes"], ["mean"], keepdims=1),  # [3, 1, 1]
        helper.make_node("Tile", ["mean", "repeats"], ["tiled"]),  # [3000, 1, 1]
        helper.make_node("Slice", ["tiled", "start", "end"], ["fc6_1"]),
    ]
    graph = helper.make_graph(
        nodes,
        "densenet_stand_in",
        [_io("data_0", TensorProto.FLOAT, [3, 224, 224])],
        [_io("fc6_1", TensorProto.FLOAT, [1000, 1, 1])],
        initializer=[
            numpy_helper.from_array(np.array([1, 2], np.int64), "axes"),
            numpy_helper.from_array(np.array([1000, 1, 1], np.int64), "repeats"),
            numpy_helper.from_array(np.array([0], np.int64), "start"),
            numpy_helper.from_array(np.array([1000], np.int64), "end"),
        ],
    )
    model = helper.make_model(
        graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)], producer_name="tests.triton_models"
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def simple_string() -> onnx.ModelProto:
    shape: list[Any] = ["batch", 16]
    nodes = [
        helper.make_node("Cast", ["INPUT0"], ["a"], to=TensorProto.INT32),
        helper.make_node("Cast", ["INPUT1"], ["b"], to=TensorProto.INT32),
        helper.make_node("Add", ["a", "b"], ["sum"]),
        helper.make_node("Sub", ["a", "b"], ["difference"]),
        helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=TensorProto.STRING),
        helper.make_node("Cast", ["difference"], ["OUTPUT1"], to=TensorProto.STRING),
    ]
    graph = helper.make_graph(
        nodes,
        "simple_string",
        [_io("INPUT0", TensorProto.STRING, shape), _io("INPUT1", TensorProto.STRING, shape)],
        [_io("OUTPUT0", TensorProto.STRING, shape), _io("OUTPUT1", TensorProto.STRING, shape)],
    )
    return make_model(graph, "Triton's simple_string: numbers in text")


def image_preprocess() -> onnx.ModelProto:
    """A P3 PPM's text ("P3 W H 255 r g b ...") -> its pixels, [batch, SIDE, SIDE, 3] in [0, 1]."""
    count = SIDE * SIDE * 3
    nodes = [
        helper.make_node("Reshape", ["IMAGE", "flat"], ["text"]),  # [batch]
        helper.make_node("StringSplit", ["text"], ["tokens", "lengths"]),  # [batch, tokens]
        # The header is 4 tokens: P3, width, height, maximum value.
        helper.make_node("Slice", ["tokens", "starts", "ends", "axes"], ["pixels"]),
        helper.make_node("Cast", ["pixels"], ["values"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["values", "maximum"], ["scaled"]),
        helper.make_node("Reshape", ["scaled", "nhwc"], ["PIXELS"]),
    ]
    constants = [
        numpy_helper.from_array(np.array([-1], np.int64), "flat"),
        numpy_helper.from_array(np.array([4], np.int64), "starts"),
        numpy_helper.from_array(np.array([4 + count], np.int64), "ends"),
        numpy_helper.from_array(np.array([1], np.int64), "axes"),
        numpy_helper.from_array(np.array(255.0, np.float32), "maximum"),
        numpy_helper.from_array(np.array([-1, SIDE, SIDE, 3], np.int64), "nhwc"),
    ]
    graph = helper.make_graph(
        nodes,
        "image_preprocess",
        [_io("IMAGE", TensorProto.STRING, ["batch", 1])],
        [_io("PIXELS", TensorProto.FLOAT, ["batch", SIDE, SIDE, 3])],
        initializer=constants,
    )
    model = helper.make_model(
        graph, ir_version=10, opset_imports=[helper.make_opsetid("", 20)], producer_name="tests.triton_models"
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def image_classifier() -> onnx.ModelProto:
    """FP32 [batch, SIDE, SIDE, 3] NHWC -> FP32 [batch, 4]: which of red, green, blue, grey the
    image's mean colour is nearest."""
    weights = np.array(
        # red, green, blue, grey: a colour's logit is its channel minus the others'; grey: balance.
        [[2, -1, -1, 0.5], [-1, 2, -1, 0.5], [-1, -1, 2, 0.5]],
        np.float32,
    )
    nodes = [
        helper.make_node("ReduceMean", ["INPUT", "hw"], ["mean"], keepdims=0),  # [batch, 3]
        helper.make_node("MatMul", ["mean", "weights"], ["OUTPUT"]),
    ]
    graph = helper.make_graph(
        nodes,
        "image_classifier",
        [_io("INPUT", TensorProto.FLOAT, ["batch", SIDE, SIDE, 3])],
        [_io("OUTPUT", TensorProto.FLOAT, ["batch", len(CLASSES)])],
        initializer=[
            numpy_helper.from_array(np.array([1, 2], np.int64), "hw"),
            numpy_helper.from_array(weights, "weights"),
        ],
    )
    model = helper.make_model(
        graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)], producer_name="tests.triton_models"
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def ppm(rgb: tuple[int, int, int]) -> bytes:
    """A SIDE x SIDE image of one colour, as P3 PPM text, its fields one space apart (ONNX
    Runtime's StringSplit splits at spaces only)."""
    pixels = " ".join(f"{rgb[0]} {rgb[1]} {rgb[2]}" for _ in range(SIDE * SIDE))
    return f"P3 {SIDE} {SIDE} 255 {pixels}".encode()


def string_numbers(values: list[int]) -> bytes:
    """BYTES elements in Triton's layout (a 4-byte little-endian length before each): the decimal
    texts of `values`, as a warm-up file of simple_string holds them."""
    return b"".join(len(t).to_bytes(4, "little") + t for t in (str(v).encode() for v in values))


SIMPLE_CONFIG: dict[str, Any] = {
    "max_batch_size": MAX_BATCH,
    "inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]},
        {"name": "INPUT1", "datatype": "INT32", "shape": [-1, 16]},
    ],
    "outputs": [
        {"name": "OUTPUT0", "datatype": "INT32", "shape": [-1, 16]},
        {"name": "OUTPUT1", "datatype": "INT32", "shape": [-1, 16]},
    ],
}

STRING_WARMUP = [
    {
        "name": "numbers",
        "batch_size": 1,
        "inputs": {
            "INPUT0": {"datatype": "BYTES", "dims": [16], "input_data_file": "numbers.bin"},
            "INPUT1": {"datatype": "BYTES", "dims": [16], "input_data_file": "numbers.bin"},
        },
    }
]


def write_simple_string(root: Path, warm_up: bool = True) -> None:
    """simple_string, with its real warm-up data (`warm_up`) or none (a synthetic warm-up)."""
    config: dict[str, Any] = {"max_batch_size": MAX_BATCH}
    if warm_up:
        config["model_warmup"] = STRING_WARMUP
    write_model(root, "simple_string", 1, simple_string(), config)
    if warm_up:
        (root / "simple_string" / "warmup").mkdir(exist_ok=True)
        (root / "simple_string" / "warmup" / "numbers.bin").write_bytes(string_numbers(list(range(16))))


ENSEMBLE_CONFIG: dict[str, Any] = {
    "platform": "ensemble",
    "max_batch_size": MAX_BATCH,
    "inputs": [{"name": "INPUT", "datatype": "BYTES", "shape": [-1, 1]}],
    "outputs": [
        {"name": "OUTPUT", "datatype": "FP32", "shape": [-1, len(CLASSES)], "label_filename": "labels.txt"}
    ],
    "ensemble_scheduling": {
        "step": [
            {
                "model_name": "image_preprocess",
                "model_version": -1,
                "input_map": {"IMAGE": "INPUT"},
                "output_map": {"PIXELS": "preprocessed"},
            },
            {
                "model_name": "image_classifier",
                "model_version": -1,
                "input_map": {"INPUT": "preprocessed"},
                "output_map": {"OUTPUT": "OUTPUT"},
            },
        ]
    },
}


def write_image_models(root: Path) -> None:
    """image_preprocess, image_classifier (NHWC, labelled) and the ensemble of both,
    preprocess_inception_ensemble (the name ensemble_image_client.py asks for by default)."""
    write_model(root, "image_preprocess", 1, image_preprocess(), {"max_batch_size": MAX_BATCH})
    classifier = {
        "max_batch_size": MAX_BATCH,
        "inputs": [
            {"name": "INPUT", "datatype": "FP32", "shape": [-1, SIDE, SIDE, 3], "format": "FORMAT_NHWC"}
        ],
        "outputs": [
            {
                "name": "OUTPUT",
                "datatype": "FP32",
                "shape": [-1, len(CLASSES)],
                "label_filename": "labels.txt",
            }
        ],
    }
    write_model(root, "image_classifier", 1, image_classifier(), classifier)
    (root / "image_classifier" / "labels.txt").write_text("\n".join(CLASSES) + "\n")
    write_ensemble(root, "preprocess_inception_ensemble", ENSEMBLE_CONFIG)
    (root / "preprocess_inception_ensemble" / "labels.txt").write_text("\n".join(CLASSES) + "\n")


def write_ensemble(root: Path, name: str, config: dict[str, Any], versions: tuple[int, ...] = (1,)) -> None:
    """An ensemble's folder: its config.yaml and empty version folders, as Triton's."""
    import yaml

    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    for version in versions:
        (folder / str(version)).mkdir(exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def write_example_repository(root: Path) -> None:
    """The eight models Triton's example clients (other than the sequence, decoupled and CUDA
    ones) ask for; simple_model_control expects exactly eight in the repository. simple_string has
    no model_warmup, as a Triton user's config would have none: it loads without a warm-up."""
    write_model(root, "simple", 1, simple(), SIMPLE_CONFIG)
    write_model(root, "simple_int8", 1, simple_int8(), {"max_batch_size": MAX_BATCH})
    write_model(root, "simple_identity", 1, simple_identity(), {"max_batch_size": MAX_BATCH})
    write_simple_string(root, warm_up=False)
    write_model(root, "densenet_onnx", 1, densenet_stand_in())
    write_image_models(root)
