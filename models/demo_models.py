"""Small, deterministic ONNX models built with ``onnx.helper``, and the bundled demo repository.

Every builder returns an ``onnx.ModelProto``; weights come from ``numpy.random.default_rng(seed)``
and models are serialized deterministically, so the same arguments always give byte-identical
files. ``python -m models.demo_models [ROOT]`` rebuilds the demo repository (default
``models/demo``); a unit test checks that the committed tree equals a fresh build.

The demo language model (``codelm``) is the one model not built here: ``models/train_demo_lm.py``
trains it (torch, a few minutes) and writes its folder into the demo repository. A rebuild keeps
that folder as it is, and the freshness test compares everything else.

IR version and opset: onnx 1.23 writes IR 14 by default, which ONNX Runtime (up to 1.31 at least)
refuses. IR 10 with opset 17 loads in every ONNX Runtime this project supports (IR 10 needs
ORT >= 1.18, the project requires >= 1.22) and has every operator used here, with CUDA kernels.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "IR_VERSION",
    "OPSET",
    "TRAINED_MODELS",
    "build_demo_repository",
    "copy_trained_models",
    "dense_classifier",
    "dense_stack",
    "main",
    "make_model",
    "mlp",
    "multi_io",
    "rebuild_demo_repository",
    "scaled_identity",
    "serialize",
    "write_model",
]

IR_VERSION = 10
OPSET = 17
PRODUCER = "modelyard.demo_models"
BATCH_DIM = "batch"
DEFAULT_ROOT = Path("models/demo")
# Model folders of the demo repository that a training script writes (models/train_demo_lm.py),
# not this module: a rebuild carries them over unchanged.
TRAINED_MODELS = ("codelm",)
# Where the committed demo repository lies, for builds elsewhere that want its trained models.
COMMITTED_ROOT = Path(__file__).resolve().parent / "demo"

# Version folder names the repository accepts: "3" (as Triton writes them) or "v3".
_VERSION_RE = re.compile(r"^v?[0-9]+$")
_CONFIG_HEADER = "# Written by models.demo_models.write_model.\n"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def make_model(graph: onnx.GraphProto, doc: str = "") -> onnx.ModelProto:
    """Wrap a graph in a model with this module's IR version, opset and producer; checked."""
    model = helper.make_model(
        graph,
        ir_version=IR_VERSION,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name=PRODUCER,
        doc_string=doc,
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def serialize(model: onnx.ModelProto) -> bytes:
    """The model's bytes, deterministic (map fields sorted), so equal models give equal files."""
    return model.SerializeToString(deterministic=True)


def _shape(features: int, batch: bool) -> list[int | str]:
    return [BATCH_DIM, features] if batch else [features]


def _weights(rng: np.random.Generator, name: str, shape: Sequence[int], scale: float) -> TensorProto:
    array = (rng.standard_normal(tuple(shape), dtype=np.float32) * np.float32(scale)).astype(np.float32)
    return numpy_helper.from_array(array, name)


def _positive(**values: int) -> None:
    for key, value in values.items():
        if value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")


def dense_classifier(
    in_features: int, hidden: int, classes: int, seed: int, batch: bool = True
) -> onnx.ModelProto:
    """A two-layer perceptron: MatMul+Add+Relu+MatMul+Add+Softmax.

    Input "INPUT0" FP32 [batch, in_features] -> output "OUTPUT0" FP32 [batch, classes], each row a
    probability distribution. With ``batch=False`` there is no batch dimension: [in_features] ->
    [classes].
    """
    _positive(in_features=in_features, hidden=hidden, classes=classes)
    rng = np.random.default_rng(seed)
    initializers = [
        _weights(rng, "W1", (in_features, hidden), 1.0 / np.sqrt(in_features)),
        _weights(rng, "B1", (hidden,), 0.1),
        _weights(rng, "W2", (hidden, classes), 1.0 / np.sqrt(hidden)),
        _weights(rng, "B2", (classes,), 0.1),
    ]
    nodes = [
        helper.make_node("MatMul", ["INPUT0", "W1"], ["h_mm"], name="fc1"),
        helper.make_node("Add", ["h_mm", "B1"], ["h_add"], name="fc1_bias"),
        helper.make_node("Relu", ["h_add"], ["h"], name="relu"),
        helper.make_node("MatMul", ["h", "W2"], ["logits_mm"], name="fc2"),
        helper.make_node("Add", ["logits_mm", "B2"], ["logits"], name="fc2_bias"),
        helper.make_node("Softmax", ["logits"], ["OUTPUT0"], name="softmax", axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "dense_classifier",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, _shape(in_features, batch))],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, _shape(classes, batch))],
        initializer=initializers,
    )
    return make_model(graph, f"dense classifier {in_features}->{hidden}->{classes}, seed {seed}")


def scaled_identity(features: int, scale: float, batch: bool = True) -> onnx.ModelProto:
    """The cheapest useful model: "OUTPUT0" = "INPUT0" * scale, FP32 [batch, features].

    Its run costs microseconds, and its output tells which scale (so which version) answered.
    """
    _positive(features=features)
    graph = helper.make_graph(
        [helper.make_node("Mul", ["INPUT0", "SCALE"], ["OUTPUT0"], name="scale")],
        "scaled_identity",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, _shape(features, batch))],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, _shape(features, batch))],
        initializer=[numpy_helper.from_array(np.array(scale, dtype=np.float32), "SCALE")],
    )
    return make_model(graph, f"INPUT0 * {scale}")


def mlp(sizes: Sequence[int], seed: int = 0) -> onnx.ModelProto:
    """A multi-layer perceptron: (MatMul + Add + Relu) per layer, no Relu after the last.

    ``sizes`` = (in, hidden..., out): "INPUT0" FP32 [batch, in] -> "OUTPUT0" FP32 [batch, out].
    (256, 1024, 1024, 16) runs in about 0.1 ms on one core: a model whose own run is as long as
    the serving path around it.
    """
    if len(sizes) < 2:
        raise ValueError("an MLP needs at least an input and an output size")
    _positive(**{f"size{i}": n for i, n in enumerate(sizes)})
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    initializers: list[TensorProto] = []
    current = "INPUT0"
    last = len(sizes) - 2
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        initializers.append(_weights(rng, f"W{i}", (n_in, n_out), 1.0 / np.sqrt(n_in)))
        initializers.append(_weights(rng, f"B{i}", (n_out,), 0.1))
        nodes.append(helper.make_node("MatMul", [current, f"W{i}"], [f"mm{i}"], name=f"fc{i}"))
        added = "OUTPUT0" if i == last else f"add{i}"
        nodes.append(helper.make_node("Add", [f"mm{i}", f"B{i}"], [added], name=f"bias{i}"))
        if i != last:
            nodes.append(helper.make_node("Relu", [added], [f"h{i}"], name=f"relu{i}"))
            current = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, [BATCH_DIM, sizes[0]])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [BATCH_DIM, sizes[-1]])],
        initializer=initializers,
    )
    return make_model(graph, f"MLP {'-'.join(str(n) for n in sizes)}, seed {seed}")


def multi_io(features: int = 4) -> onnx.ModelProto:
    """Two inputs of different types, two outputs: for output selection and mixed dtypes.

    Inputs "a" FP32 [batch, features] and "b" INT64 [batch, features]; outputs "sum" FP32
    [batch, features] = a + float(b), and "argmax" INT64 [batch] = argmax of a along axis 1
    (first index on ties).
    """
    _positive(features=features)
    nodes = [
        helper.make_node("Cast", ["b"], ["b_float"], name="cast_b", to=TensorProto.FLOAT),
        helper.make_node("Add", ["a", "b_float"], ["sum"], name="add"),
        helper.make_node("ArgMax", ["a"], ["argmax"], name="argmax", axis=1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "multi_io",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [BATCH_DIM, features]),
            helper.make_tensor_value_info("b", TensorProto.INT64, [BATCH_DIM, features]),
        ],
        [
            helper.make_tensor_value_info("sum", TensorProto.FLOAT, [BATCH_DIM, features]),
            helper.make_tensor_value_info("argmax", TensorProto.INT64, [BATCH_DIM]),
        ],
    )
    return make_model(graph, "sum = a + cast(b); argmax = argmax(a, axis=1)")


def dense_stack(layers: int = 32, width: int = 512, seed: int = 0) -> onnx.ModelProto:
    """A weight-bandwidth-bound model for batching benchmarks: ``layers`` x (MatMul width x width, Relu).

    Input "INPUT0" FP32 [batch, width] -> "OUTPUT0" FP32 [batch, width]. The default is 32 MiB of
    weights: build it on the fly, never commit it.
    """
    _positive(layers=layers, width=width)
    rng = np.random.default_rng(seed)
    scale = np.sqrt(2.0 / width)  # He initialisation keeps activations bounded through the Relus
    nodes: list[onnx.NodeProto] = []
    initializers: list[TensorProto] = []
    current = "INPUT0"
    for i in range(layers):
        weight, product = f"W{i}", f"mm{i}"
        out = "OUTPUT0" if i == layers - 1 else f"h{i}"
        initializers.append(_weights(rng, weight, (width, width), scale))
        nodes.append(helper.make_node("MatMul", [current, weight], [product], name=f"layer{i}"))
        nodes.append(helper.make_node("Relu", [product], [out], name=f"relu{i}"))
        current = out
    graph = helper.make_graph(
        nodes,
        "dense_stack",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, [BATCH_DIM, width])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [BATCH_DIM, width])],
        initializer=initializers,
    )
    return make_model(graph, f"{layers} x MatMul {width}x{width} + Relu, seed {seed}")


def encoder(
    layers: int = 6, hidden: int = 384, heads: int = 12, ffn: int = 1536, seq: int = 128, seed: int = 0
) -> onnx.ModelProto:
    """A transformer encoder shaped like MiniLM-L6's body (6 layers, hidden 384, 12 heads, FFN 1536:
    10.6 M parameters, 43 MB; MiniLM's other 12 M are its token embeddings, looked up before this),
    for the GPU check: a model of the size people serve, built here.

    Input "INPUT0" FP32 [batch, seq, hidden] (embeddings) -> "OUTPUT0" FP32 [batch, hidden], the mean
    over the sequence of the last layer. Each layer: multi-head self-attention (Q, K, V projections,
    softmax(QK^T / sqrt(d)) V, output projection), residual + LayerNormalization, FFN with Gelu (the
    erf form), residual + LayerNormalization. Build it on the fly, never commit it.
    """
    _positive(layers=layers, hidden=hidden, heads=heads, ffn=ffn, seq=seq)
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    rng = np.random.default_rng(seed)
    head = hidden // heads
    nodes: list[onnx.NodeProto] = []
    inits: list[TensorProto] = [
        numpy_helper.from_array(np.array([0, 0, heads, head], np.int64), "split_heads"),
        numpy_helper.from_array(np.array([0, 0, hidden], np.int64), "merge_heads"),
        numpy_helper.from_array(np.array(1.0 / np.sqrt(head), np.float32), "scale"),
        numpy_helper.from_array(np.array(1.0 / np.sqrt(2.0), np.float32), "inv_sqrt2"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
    ]

    def dense(x: str, name: str, rows: int, cols: int) -> str:
        inits.append(_weights(rng, f"{name}.w", (rows, cols), np.sqrt(1.0 / rows)))
        inits.append(numpy_helper.from_array(np.zeros(cols, np.float32), f"{name}.b"))
        nodes.append(helper.make_node("MatMul", [x, f"{name}.w"], [f"{name}.mm"]))
        nodes.append(helper.make_node("Add", [f"{name}.mm", f"{name}.b"], [name]))
        return name

    def norm(x: str, name: str) -> str:
        inits.append(numpy_helper.from_array(np.ones(hidden, np.float32), f"{name}.g"))
        inits.append(numpy_helper.from_array(np.zeros(hidden, np.float32), f"{name}.beta"))
        scale_bias = [x, f"{name}.g", f"{name}.beta"]
        nodes.append(helper.make_node("LayerNormalization", scale_bias, [name], axis=-1))
        return name

    def heads_of(x: str, name: str, perm: list[int]) -> str:
        nodes.append(helper.make_node("Reshape", [x, "split_heads"], [f"{name}.r"]))
        nodes.append(helper.make_node("Transpose", [f"{name}.r"], [name], perm=perm))
        return name

    x = "INPUT0"
    for i in range(layers):
        p = f"l{i}"
        q = heads_of(dense(x, f"{p}.q", hidden, hidden), f"{p}.qh", [0, 2, 1, 3])  # [b, h, s, d]
        k = heads_of(dense(x, f"{p}.k", hidden, hidden), f"{p}.kh", [0, 2, 3, 1])  # [b, h, d, s]
        v = heads_of(dense(x, f"{p}.v", hidden, hidden), f"{p}.vh", [0, 2, 1, 3])
        nodes.append(helper.make_node("MatMul", [q, k], [f"{p}.qk"]))
        nodes.append(helper.make_node("Mul", [f"{p}.qk", "scale"], [f"{p}.scaled"]))
        nodes.append(helper.make_node("Softmax", [f"{p}.scaled"], [f"{p}.attn"], axis=-1))
        nodes.append(helper.make_node("MatMul", [f"{p}.attn", v], [f"{p}.ctx"]))
        nodes.append(helper.make_node("Transpose", [f"{p}.ctx"], [f"{p}.ctx_t"], perm=[0, 2, 1, 3]))
        nodes.append(helper.make_node("Reshape", [f"{p}.ctx_t", "merge_heads"], [f"{p}.merged"]))
        attended = dense(f"{p}.merged", f"{p}.o", hidden, hidden)
        nodes.append(helper.make_node("Add", [x, attended], [f"{p}.res1"]))
        h = norm(f"{p}.res1", f"{p}.ln1")
        up = dense(h, f"{p}.up", hidden, ffn)
        # Gelu, erf form: 0.5 x (1 + erf(x / sqrt 2))
        nodes.append(helper.make_node("Mul", [up, "inv_sqrt2"], [f"{p}.gs"]))
        nodes.append(helper.make_node("Erf", [f"{p}.gs"], [f"{p}.erf"]))
        nodes.append(helper.make_node("Add", [f"{p}.erf", "one"], [f"{p}.erf1"]))
        nodes.append(helper.make_node("Mul", [up, f"{p}.erf1"], [f"{p}.gx"]))
        nodes.append(helper.make_node("Mul", [f"{p}.gx", "half"], [f"{p}.gelu"]))
        down = dense(f"{p}.gelu", f"{p}.down", ffn, hidden)
        nodes.append(helper.make_node("Add", [h, down], [f"{p}.res2"]))
        x = norm(f"{p}.res2", f"{p}.ln2")
    nodes.append(helper.make_node("ReduceMean", [x], ["OUTPUT0"], axes=[1], keepdims=0))
    graph = helper.make_graph(
        nodes,
        "encoder",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, [BATCH_DIM, seq, hidden])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [BATCH_DIM, hidden])],
        initializer=inits,
    )
    shape = f"{layers} layers, hidden {hidden}, {heads} heads, FFN {ffn}, seq {seq}"
    return make_model(graph, f"encoder: {shape}")


def _write_atomic(path: Path, data: bytes) -> None:
    """Write to a hidden temp file in the same folder, then rename over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_model(
    root: Path,
    name: str,
    version: int | str,
    model: onnx.ModelProto,
    config: Mapping[str, object] | None = None,
) -> Path:
    """Write ``root/name/<version>/model.onnx`` (and ``root/name/config.yaml`` when given), atomically.

    ``version`` is an int (folder "3") or a folder name, "3" or "v3". Returns the model file's path.
    """
    if not _NAME_RE.match(name):
        raise ValueError(f"invalid model name {name!r}")
    folder = str(version)
    if isinstance(version, bool) or not _VERSION_RE.match(folder):
        raise ValueError(f"invalid version {version!r}: expected an int, 'N' or 'vN'")
    model_dir = Path(root) / name
    version_dir = model_dir / folder
    version_dir.mkdir(parents=True, exist_ok=True)
    path = version_dir / "model.onnx"
    _write_atomic(path, serialize(model))
    if config is not None:
        text = _CONFIG_HEADER + yaml.safe_dump(dict(config), sort_keys=False, default_flow_style=None)
        _write_atomic(model_dir / "config.yaml", text.encode("utf-8"))
    return path


def _io(name: str, datatype: str, shape: Sequence[int]) -> dict[str, object]:
    return {"name": name, "datatype": datatype, "shape": list(shape)}


def build_demo_repository(root: Path) -> None:
    """Write the bundled demo models into ``root`` (which may already hold other models).

    - ``classifier/1``: dense_classifier 64 -> 32 -> 8, max batch 32, full config.
    - ``scaler/1`` (INPUT0 * 2.0) and ``scaler/2`` (INPUT0 * 3.0), 16 features, latest 2 served.
    - ``mixed/v1``: multi_io (a FP32 + b INT64 -> sum FP32, argmax INT64), a ``v<N>`` folder.
    """
    write_model(
        root,
        "classifier",
        1,
        dense_classifier(64, 32, 8, seed=1),
        {
            "max_batch_size": 32,
            "version_policy": {"latest": 1},
            "inputs": [_io("INPUT0", "FP32", [-1, 64])],
            "outputs": [_io("OUTPUT0", "FP32", [-1, 8])],
            "execution": {
                "provider": "auto",
                "device_id": 0,
                "gpu_mem_limit_mb": 0,
                "intra_op_threads": 0,
                "inter_op_threads": 0,
            },
            "dynamic_batching": {"max_queue_delay_us": 2000, "preferred_batch_sizes": [8, 16]},
        },
    )
    scaler_config: dict[str, object] = {"max_batch_size": 64, "version_policy": {"latest": 2}}
    write_model(root, "scaler", 1, scaled_identity(16, 2.0), scaler_config)
    write_model(root, "scaler", 2, scaled_identity(16, 3.0), scaler_config)
    write_model(
        root,
        "mixed",
        "v1",
        multi_io(4),
        {
            "max_batch_size": 8,
            "inputs": [_io("a", "FP32", [-1, 4]), _io("b", "INT64", [-1, 4])],
            "outputs": [_io("sum", "FP32", [-1, 4]), _io("argmax", "INT64", [-1])],
        },
    )


def _looks_like_repository(root: Path) -> bool:
    """True when every entry is a model folder holding only version folders and config.yaml."""
    for model_dir in root.iterdir():
        if not model_dir.is_dir() or model_dir.is_symlink():
            return False
        for entry in model_dir.iterdir():
            if entry.name == "config.yaml" and entry.is_file():
                continue
            if not (entry.is_dir() and _VERSION_RE.match(entry.name)):
                return False
    return True


def copy_trained_models(source: Path, root: Path) -> list[str]:
    """Copy the trained demo models (TRAINED_MODELS) that ``source`` holds into ``root``; returns
    the names copied."""
    copied = []
    for name in TRAINED_MODELS:
        if (source / name).is_dir():
            shutil.copytree(source / name, root / name, dirs_exist_ok=True)
            copied.append(name)
    return copied


def rebuild_demo_repository(root: Path) -> None:
    """Replace ``root`` with a fresh demo repository: built aside, then swapped in. The trained
    models (TRAINED_MODELS) already in ``root`` are carried over unchanged.

    Refuses to delete a folder that does not look like a model repository.
    """
    root = Path(root)
    if root.exists() and not (root.is_dir() and _looks_like_repository(root)):
        raise ValueError(f"refusing to replace {root}: it does not look like a model repository")
    root.parent.mkdir(parents=True, exist_ok=True)
    fresh = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}.new."))
    old: Path | None = None
    try:
        fresh.chmod(0o755)
        build_demo_repository(fresh)
        if root.exists():
            copy_trained_models(root, fresh)
            old = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}.old."))
            os.replace(root, old / root.name)
        os.replace(fresh, root)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m models.demo_models [ROOT]``: rebuild the demo repository (default models/demo)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) > 1 or (args and args[0] in ("-h", "--help")):
        print(f"usage: python -m models.demo_models [ROOT]   (default {DEFAULT_ROOT})", file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    root = Path(args[0]) if args else DEFAULT_ROOT
    try:
        rebuild_demo_repository(root)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"demo repository written to {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
