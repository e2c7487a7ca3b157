"""A GPT-2 style decoder in the Hugging Face ONNX layout, built with onnx.helper from random weights
(no torch), and a small tokenizer for it: a stand-in for a user's own export.

It is deliberately not the demo model's graph: GPT-2's own conventions (combined c_attn, additive
attention mask with the dtype's minimum, tanh GELU, tied lm_head), its own dimension names, a
logits width padded past the tokenizer's vocabulary, and optionally no position_ids input (older
exports compute positions inside the graph). The service must serve it from the layout alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from models.demo_models import IR_VERSION, OPSET

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine",
    "all that glitters is not gold",
    "to be or not to be that is the question",
    "def main(): return 0",
] * 4
EOS = "</s>"


def tiny_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


def gpt2_like(
    vocab: int,
    layers: int = 2,
    heads: int = 2,
    head_size: int = 16,
    positions: int = 128,
    position_ids: bool = True,
    seed: int = 0,
    metadata: bool = True,
) -> onnx.ModelProto:
    """logits width = vocab rounded up to a multiple of 64 (as exports pad embedding matrices).
    `positions` rows in the position table; `metadata`: n_positions in the ONNX metadata (optimum
    writes none: the context is then in config.json beside the model, or the table's size)."""
    rng = np.random.default_rng(seed)
    width = heads * head_size
    padded_vocab = -(-vocab // 64) * 64
    nodes: list[onnx.NodeProto] = []
    inits: list[TensorProto] = []
    counter = [0]

    def const(array: np.ndarray | np.generic) -> str:
        counter[0] += 1
        name = f"const_{counter[0]}"
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(*shape: int, scale: float) -> str:
        return const((rng.standard_normal(shape) * scale).astype(np.float32))

    def op(kind: str, *inputs: str, out: str = "", **attrs: Any) -> str:
        counter[0] += 1
        out = out or f"{kind.lower()}_{counter[0]}"
        nodes.append(helper.make_node(kind, list(inputs), [out], **attrs))
        return out

    def i64(*values: int) -> str:
        return const(np.asarray(values, dtype=np.int64))

    f32_min = const(np.asarray(np.finfo(np.float32).min, dtype=np.float32))
    one_f = const(np.asarray(1.0, dtype=np.float32))
    scalar_1 = const(np.asarray(1, dtype=np.int64))
    scalar_0 = const(np.asarray(0, dtype=np.int64))

    seq = op("Gather", op("Shape", "input_ids"), scalar_1, axis=0)
    total = op("Gather", op("Shape", "attention_mask"), scalar_1, axis=0)
    past_len = op("Sub", total, seq)
    # Without a position_ids input, positions are computed the way older exports do: past + index.
    pos = "position_ids" if position_ids else op("Unsqueeze", op("Range", past_len, total, scalar_1), i64(0))
    wte = weight(padded_vocab, width, scale=1.0)
    h = op("Add", op("Gather", wte, "input_ids"), op("Gather", weight(positions, width, scale=0.5), pos))
    causal = op(
        "LessOrEqual",
        op("Unsqueeze", op("Range", scalar_0, total, scalar_1), i64(0)),
        op("Unsqueeze", op("Range", past_len, total, scalar_1), i64(1)),
    )
    mask_f = op("Cast", op("Unsqueeze", "attention_mask", i64(1, 2)), to=TensorProto.FLOAT)
    additive = op("Mul", op("Sub", one_f, mask_f), f32_min)  # [B, 1, 1, T]

    def layer_norm(x: str) -> str:
        gamma = const((1 + 0.1 * rng.standard_normal(width)).astype(np.float32))
        beta = const((0.1 * rng.standard_normal(width)).astype(np.float32))
        return op("LayerNormalization", x, gamma, beta, axis=-1, epsilon=1e-5)

    def split_heads(x: str) -> str:
        return op("Transpose", op("Reshape", x, i64(0, 0, heads, head_size)), perm=[0, 2, 1, 3])

    for i in range(layers):
        qkv = op(
            "Add",
            op("MatMul", layer_norm(h), weight(width, 3 * width, scale=0.4)),
            weight(3 * width, scale=0.1),
        )
        q, k, v = f"q{i}", f"k{i}", f"v{i}"
        nodes.append(helper.make_node("Split", [qkv, i64(width, width, width)], [q, k, v], axis=2))
        key = op("Concat", f"past_key_values.{i}.key", split_heads(k), out=f"present.{i}.key", axis=2)
        value = op("Concat", f"past_key_values.{i}.value", split_heads(v), out=f"present.{i}.value", axis=2)
        scores = op(
            "Div",
            op("MatMul", split_heads(q), op("Transpose", key, perm=[0, 1, 3, 2])),
            const(np.asarray(math.sqrt(head_size), dtype=np.float32)),
        )
        scores = op("Add", op("Where", causal, scores, f32_min), additive)
        merged = op(
            "Reshape",
            op("Transpose", op("MatMul", op("Softmax", scores, axis=-1), value), perm=[0, 2, 1, 3]),
            i64(0, 0, width),
        )
        h = op("Add", h, op("MatMul", merged, weight(width, width, scale=0.2)))
        fc = op("MatMul", layer_norm(h), weight(width, 4 * width, scale=0.2))
        # GPT-2's tanh GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        inner = op(
            "Mul",
            op("Add", fc, op("Mul", op("Pow", fc, const(np.float32(3.0))), const(np.float32(0.044715)))),
            const(np.float32(math.sqrt(2 / math.pi))),
        )
        gelu = op("Mul", op("Mul", fc, const(np.float32(0.5))), op("Add", op("Tanh", inner), one_f))
        h = op("Add", h, op("MatMul", gelu, weight(4 * width, width, scale=0.1)))
    op("MatMul", layer_norm(h), op("Transpose", wte, perm=[1, 0]), out="logits")

    kv_in: list[str | int] = ["batch", heads, "past_seq", head_size]
    kv_out: list[str | int] = ["batch", heads, "past_seq + seq", head_size]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "past_seq + seq"]),
    ]
    if position_ids:
        inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]))
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", padded_vocab])]
    for i in range(layers):
        for kind in ("key", "value"):
            inputs.append(
                helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", TensorProto.FLOAT, kv_in)
            )
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT, kv_out))
    graph = helper.make_graph(nodes, "gpt2_like", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[helper.make_opsetid("", OPSET)])
    if metadata:
        helper.set_model_props(model, {"n_positions": str(positions)})
    onnx.checker.check_model(model, full_check=True)
    return model


def write_decoder(
    root: Path, name: str, model: onnx.ModelProto, tokenizer: Tokenizer, config: str = ""
) -> Path:
    """root/name/1/{model.onnx, tokenizer.json} (+ root/name/config.yaml)."""
    version = root / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    (version / "model.onnx").write_bytes(model.SerializeToString())
    tokenizer.save(str(version / "tokenizer.json"))
    if config:
        (root / name / "config.yaml").write_text(config)
    return version / "model.onnx"


def write_export(
    root: Path,
    name: str,
    model: onnx.ModelProto,
    tokenizer: Tokenizer,
    files: dict[str, Any] | None = None,
    config: str = "",
) -> Path:
    """A folder as optimum writes one: model.onnx and tokenizer.json, with the JSON `files`
    beside them (config.json, generation_config.json, tokenizer_config.json: name -> object; a
    str value is written as it is: chat_template.jinja)."""
    model_file = write_decoder(root, name, model, tokenizer, config)
    for file_name, value in (files or {}).items():
        text = value if isinstance(value, str) else json.dumps(value, indent=2)
        (model_file.parent / file_name).write_text(text)
    return model_file


def reference_logits(model_file: Path, ids: list[int]) -> np.ndarray:
    """Every position's logits for `ids`, by one run without a cache: [len(ids), padded vocab]."""
    session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    names = {i.name: i for i in session.get_inputs()}
    array = np.asarray(ids, dtype=np.int64)[None]
    feeds: dict[str, np.ndarray] = {"input_ids": array, "attention_mask": np.ones_like(array)}
    if "position_ids" in names:
        feeds["position_ids"] = np.arange(len(ids), dtype=np.int64)[None]
    for name, spec in names.items():
        if name.startswith("past_key_values."):
            feeds[name] = np.zeros((1, spec.shape[1], 0, spec.shape[3]), dtype=np.float32)
    return np.asarray(session.run(["logits"], feeds)[0][0])


def reference_greedy(model_file: Path, prompt: list[int], n: int, vocab: int) -> list[int]:
    """The plain way, for comparison: recompute the whole sequence for every token, no cache."""
    session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    names = {i.name: i for i in session.get_inputs()}
    layers = sum(1 for name in names if name.endswith(".key"))
    heads, head_size = names["past_key_values.0.key"].shape[1], names["past_key_values.0.key"].shape[3]
    ids = list(prompt)
    for _ in range(n):
        array = np.asarray(ids, dtype=np.int64)[None]
        feeds = {"input_ids": array, "attention_mask": np.ones_like(array)}
        if "position_ids" in names:
            feeds["position_ids"] = np.arange(len(ids), dtype=np.int64)[None]
        for i in range(layers):
            for kind in ("key", "value"):
                feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, heads, 0, head_size), dtype=np.float32)
        logits = session.run(["logits"], feeds)[0]
        ids.append(int(np.argmax(logits[0, -1, :vocab])))
    return ids[len(prompt) :]
