"""Train the demo language model and write it into the demo repository (models/demo/codelm).

    .venv/bin/pip install torch==2.13.0          # CPU build, development only; never a runtime dependency
    .venv/bin/python models/train_demo_lm.py     # ~6 minutes on 2 cores

What it makes: a small decoder-only transformer (4 layers, width 128, 4 heads, context 256) and a
byte-level BPE tokenizer (2048 tokens), both trained on the Python standard library's own source
files, which every machine with Python has: a toy code-completion model. Its output is
recognisably Python (indentation, `def`, `self.`, `return`), not good Python.

The ONNX file is written by hand with onnx.helper from the trained weights, not by torch.onnx: the
graph is exactly the Hugging Face decoder layout the service serves (input_ids, attention_mask,
position_ids, past_key_values.<i>.key/value -> logits, present.<i>.key/value; dynamic batch and
sequence dimensions), its IR version is one ONNX Runtime accepts, and its bytes depend only on the
weights. The script checks the ONNX graph against the torch model, with and without a KV cache,
before it writes anything.

Reproducing: the same Python version (the corpus is its standard library) and torch version give
the same files; another Python gives a model of the same shape and quality.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import yaml
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "models" / "demo" / "codelm"
EOS = "<|endoftext|>"
# Where a chat reply (a function the template opened) ends: what follows a function in a file.
CHAT_STOP = ("\ndef ", "\nclass ", "\n@", "\n\n\n")
IR_VERSION = 10  # onnx 1.23 writes 14 by default, which ONNX Runtime refuses
OPSET = 17
MASKED = -1e9  # the score of a position a query must not see; finite, so a fully masked row stays NaN-free
SKIP_DIRS = {"test", "tests", "site-packages", "idlelib", "lib2to3", "__pycache__"}


@dataclass(frozen=True)
class Shape:
    vocab: int = 2048
    width: int = 128
    layers: int = 4
    heads: int = 4
    context: int = 256

    @property
    def head_size(self) -> int:
        return self.width // self.heads


# --- corpus and tokenizer -----------------------------------------------------------------------


def corpus_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.rglob("*.py")) if not SKIP_DIRS.intersection(p.relative_to(root).parts)]


def read_corpus() -> list[str]:
    texts = []
    for path in corpus_files():
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return texts


def train_tokenizer(texts: list[str], vocab: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def token_stream(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """Every file's tokens, each file followed by the end-of-text token."""
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


# --- the model ----------------------------------------------------------------------------------


def build_torch_model(shape: Shape):  # type: ignore[no-untyped-def]
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(shape.width)
            self.qkv = nn.Linear(shape.width, 3 * shape.width)
            self.proj = nn.Linear(shape.width, shape.width)
            self.ln2 = nn.LayerNorm(shape.width)
            self.fc1 = nn.Linear(shape.width, 4 * shape.width)
            self.fc2 = nn.Linear(4 * shape.width, shape.width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(shape.width, dim=2)
            q, k, v = (t.view(b, s, shape.heads, shape.head_size).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, s, shape.width))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(shape.vocab, shape.width)
            self.pos = nn.Embedding(shape.context, shape.width)
            self.blocks = nn.ModuleList(Block() for _ in range(shape.layers))
            self.ln_f = nn.LayerNorm(shape.width)
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)
                if name.endswith(("proj.weight", "fc2.weight")):  # GPT-2's scaled residual init
                    nn.init.normal_(p, std=0.02 / math.sqrt(2 * shape.layers))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.ln_f(x) @ self.tok.weight.T  # tied output embedding

    return LM()


def train(shape: Shape, data: np.ndarray, steps: int, batch: int, seq: int, seed: int):  # type: ignore[no-untyped-def]
    import torch
    from torch.nn import functional as F

    torch.manual_seed(seed)
    torch.set_num_threads(2)
    rng = np.random.default_rng(seed)
    model = build_torch_model(shape)
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.95),
    )
    warmup = max(1, steps // 20)
    start = time.time()
    for step in range(steps):
        lr = 3e-3 * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        offsets = rng.integers(0, len(data) - seq - 1, size=batch)
        window = torch.from_numpy(np.stack([data[o : o + seq + 1] for o in offsets]))
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, shape.vocab), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(
                f"step {step:5d}  loss {loss.item():.3f}  lr {lr:.2e}  {time.time() - start:.0f}s", flush=True
            )
    model.eval()
    return model


def weights_of(model) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    return {name: t.detach().numpy().astype(np.float32) for name, t in model.state_dict().items()}


# --- ONNX, in the Hugging Face decoder layout -------------------------------------------------


class _Graph:
    """A tiny helper that names nodes and collects initializers."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._count = 0

    def op(self, op_type: str, inputs: list[str], **attrs: object) -> str:
        self._count += 1
        out = f"{op_type.lower()}_{self._count}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def named(self, op_type: str, inputs: list[str], output: str, **attrs: object) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=output, **attrs))
        return output

    def const(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(array, name))
        return name


def export_onnx(weights: dict[str, np.ndarray], shape: Shape) -> onnx.ModelProto:
    g = _Graph()
    used: set[str] = set()

    def w(name: str) -> str:  # an initializer only for the weights a node uses as they are
        if name not in used:
            used.add(name)
            g.const(name, weights[name])
        return name

    i64 = lambda name, values: g.const(name, np.asarray(values, dtype=np.int64))  # noqa: E731
    one, axis1, axes_12 = i64("c_one", 1), i64("c_axis1", [1]), i64("c_axes12", [1, 2])
    axis0 = i64("c_axis0", [0])
    heads_shape = i64("c_heads_shape", [0, 0, shape.heads, shape.head_size])
    width_shape = i64("c_width_shape", [0, 0, shape.width])
    split = i64("c_split", [shape.width] * 3)
    scale = g.const("c_scale", np.asarray(1.0 / math.sqrt(shape.head_size), dtype=np.float32))
    masked = g.const("c_masked", np.asarray(MASKED, dtype=np.float32))
    half, sqrt2 = g.const("c_half", np.float32(0.5)), g.const("c_sqrt2", np.float32(math.sqrt(2.0)))
    one_f = g.const("c_one_f", np.float32(1.0))
    idx1 = g.const("c_idx1", np.asarray(1, dtype=np.int64))
    zero = g.const("c_zero", np.asarray(0, dtype=np.int64))

    # Which keys each query may see: causal (by index within the total sequence) and not padding.
    seq_len = g.op("Gather", [g.op("Shape", ["input_ids"]), idx1], axis=0)
    total = g.op("Gather", [g.op("Shape", ["attention_mask"]), idx1], axis=0)
    past_len = g.op("Sub", [total, seq_len])
    key_index = g.op("Unsqueeze", [g.op("Range", [zero, total, one]), axis0])  # [1, T]
    query_index = g.op("Unsqueeze", [g.op("Range", [past_len, total, one]), axis1])  # [S, 1]
    causal = g.op("LessOrEqual", [key_index, query_index])  # [S, T]
    not_pad = g.op("Unsqueeze", [g.op("Cast", ["attention_mask"], to=TensorProto.BOOL), axes_12])
    allowed = g.op("And", [causal, not_pad])  # [B, 1, S, T]

    x = g.op(
        "Add",
        [g.op("Gather", [w("tok.weight"), "input_ids"]), g.op("Gather", [w("pos.weight"), "position_ids"])],
    )

    def layer_norm(h: str, prefix: str) -> str:
        return g.op(
            "LayerNormalization", [h, w(f"{prefix}.weight"), w(f"{prefix}.bias")], axis=-1, epsilon=1e-5
        )

    def linear(h: str, prefix: str) -> str:
        weight_t = g.const(f"{prefix}.weight_t", np.ascontiguousarray(weights[f"{prefix}.weight"].T))
        return g.op("Add", [g.op("MatMul", [h, weight_t]), w(f"{prefix}.bias")])

    def heads(h: str) -> str:  # [B, S, width] -> [B, heads, S, head_size]
        return g.op("Transpose", [g.op("Reshape", [h, heads_shape])], perm=[0, 2, 1, 3])

    for i in range(shape.layers):
        p = f"blocks.{i}"
        qkv = linear(layer_norm(x, f"{p}.ln1"), f"{p}.qkv")
        q_flat, k_flat, v_flat = (f"{p}.q", f"{p}.k", f"{p}.v")
        g.nodes.append(
            helper.make_node("Split", [qkv, split], [q_flat, k_flat, v_flat], name=f"{p}.split", axis=2)
        )
        key = g.named("Concat", [f"past_key_values.{i}.key", heads(k_flat)], f"present.{i}.key", axis=2)
        value = g.named("Concat", [f"past_key_values.{i}.value", heads(v_flat)], f"present.{i}.value", axis=2)
        scores = g.op(
            "Mul", [g.op("MatMul", [heads(q_flat), g.op("Transpose", [key], perm=[0, 1, 3, 2])]), scale]
        )
        probs = g.op("Softmax", [g.op("Where", [allowed, scores, masked])], axis=-1)
        attended = g.op(
            "Reshape", [g.op("Transpose", [g.op("MatMul", [probs, value])], perm=[0, 2, 1, 3]), width_shape]
        )
        x = g.op("Add", [x, linear(attended, f"{p}.proj")])
        hidden = linear(layer_norm(x, f"{p}.ln2"), f"{p}.fc1")
        gelu = g.op(
            "Mul",
            [g.op("Mul", [hidden, half]), g.op("Add", [g.op("Erf", [g.op("Div", [hidden, sqrt2])]), one_f])],
        )
        x = g.op("Add", [x, linear(gelu, f"{p}.fc2")])

    # The output embedding is the input one (tied), transposed in the graph: ONNX Runtime folds the
    # Transpose into a constant at load time, and the file holds the matrix once.
    g.named("MatMul", [layer_norm(x, "ln_f"), g.op("Transpose", [w("tok.weight")], perm=[1, 0])], "logits")

    kv = ["batch_size", shape.heads, "past_sequence_length", shape.head_size]
    present = ["batch_size", shape.heads, "total_sequence_length", shape.head_size]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info(
            "attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]
        ),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
    ]
    outputs = [
        helper.make_tensor_value_info(
            "logits", TensorProto.FLOAT, ["batch_size", "sequence_length", shape.vocab]
        )
    ]
    for i in range(shape.layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", TensorProto.FLOAT, kv))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT, present))
    graph = helper.make_graph(g.nodes, "codelm", inputs, outputs, initializer=g.initializers)
    model = helper.make_model(
        graph,
        ir_version=IR_VERSION,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="modelyard.train_demo_lm",
        doc_string="A toy code-completion model trained on the Python standard library.",
    )
    # The context length is not visible in the graph's inputs; the service reads it from here.
    helper.set_model_props(model, {"context_length": str(shape.context)})
    onnx.checker.check_model(model, full_check=True)
    return model


# --- checks and writing -------------------------------------------------------------------------


def check_against_torch(model_bytes: bytes, torch_model, shape: Shape, ids: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    """The ONNX graph gives torch's logits: for the whole prompt at once, and token by token
    through the KV cache (the way the service runs it)."""
    import torch

    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    with torch.no_grad():
        expected = torch_model(torch.from_numpy(ids[None])).numpy()[0]
    empty = np.zeros((1, shape.heads, 0, shape.head_size), dtype=np.float32)
    past = {f"past_key_values.{i}.{k}": empty for i in range(shape.layers) for k in ("key", "value")}
    names = [o.name for o in session.get_outputs()]

    def run(
        chunk: np.ndarray, start: int, past: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        feeds = {
            "input_ids": chunk[None],
            "attention_mask": np.ones((1, start + len(chunk)), dtype=np.int64),
            "position_ids": np.arange(start, start + len(chunk), dtype=np.int64)[None],
            **past,
        }
        out = dict(zip(names, session.run(names, feeds), strict=True))
        new_past = {
            n.replace("present", "past_key_values"): v for n, v in out.items() if n.startswith("present")
        }
        return out["logits"][0], new_past

    whole, _ = run(ids, 0, past)
    np.testing.assert_allclose(whole, expected, atol=2e-3, rtol=1e-3)
    half = len(ids) // 2
    first, cache = run(ids[:half], 0, past)
    steps = [first]
    for i in range(half, len(ids)):
        logits, cache = run(ids[i : i + 1], i, cache)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps), expected, atol=2e-3, rtol=1e-3)


def greedy_sample(model_bytes: bytes, tokenizer: Tokenizer, prompt: str, n: int, shape: Shape) -> str:
    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    ids = tokenizer.encode(prompt).ids
    for _ in range(n):
        window = np.asarray(ids[-shape.context :], dtype=np.int64)
        empty = np.zeros((1, shape.heads, 0, shape.head_size), dtype=np.float32)
        feeds = {
            "input_ids": window[None],
            "attention_mask": np.ones((1, len(window)), dtype=np.int64),
            "position_ids": np.arange(len(window), dtype=np.int64)[None],
            **{f"past_key_values.{i}.{k}": empty for i in range(shape.layers) for k in ("key", "value")},
        }
        ids.append(int(np.argmax(session.run(["logits"], feeds)[0][0, -1])))
    return str(tokenizer.decode(ids))


def write(
    out: Path, model: onnx.ModelProto, tokenizer: Tokenizer, shape: Shape, info: dict[str, object]
) -> None:
    version = out / "1"
    version.mkdir(parents=True, exist_ok=True)
    (version / "model.onnx").write_bytes(model.SerializeToString(deterministic=True))
    # Sorted keys and a fixed indent, so the same tokenizer always gives the same bytes.
    text = json.dumps(json.loads(tokenizer.to_str()), indent=1, sort_keys=True, ensure_ascii=False)
    (version / "tokenizer.json").write_text(text + "\n", encoding="utf-8")
    config = {
        "generation": {
            "max_concurrent_sequences": 32,
            "max_waiting": 64,
            "max_tokens": 256,
            "default_max_tokens": 64,
            "context_length": shape.context,
            "eos_token": EOS,
            "continuous_batching": True,
            "stream_buffer": 16,
            # The chat template (1/chat_template.jinja, kept beside what this writes) opens the
            # reply's function: the reply's text begins with it and ends where the function does.
            "chat_stop": list(CHAT_STOP),
            "chat_reply_opening": True,
        }
    }
    header = "# Written by models/train_demo_lm.py; " + ", ".join(f"{k} {v}" for k, v in info.items()) + ".\n"
    (out / "config.yaml").write_text(header + yaml.safe_dump(config, sort_keys=False), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=1800)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = Shape()

    texts = read_corpus()
    print(f"corpus: {len(texts)} files, {sum(map(len, texts)) / 1e6:.1f} M characters", flush=True)
    tokenizer = train_tokenizer(texts, shape.vocab)
    data = token_stream(tokenizer, texts)
    print(f"tokens: {len(data) / 1e6:.2f} M", flush=True)
    torch_model = train(shape, data, args.steps, args.batch, args.seq, args.seed)
    model = export_onnx(weights_of(torch_model), shape)
    model_bytes = model.SerializeToString(deterministic=True)
    check_against_torch(model_bytes, torch_model, shape, data[1000 : 1000 + 96])
    print("ONNX graph matches torch (whole prompt and token by token through the KV cache)")
    write(
        args.out,
        model,
        tokenizer,
        shape,
        {"steps": args.steps, "batch": args.batch, "seq": args.seq, "seed": args.seed},
    )
    print(f"wrote {args.out} ({len(model_bytes) / 1e6:.1f} MB model)")
    for prompt in ("def ", "import os\n\n\nclass "):
        print(f"--- greedy from {prompt!r}:\n{greedy_sample(model_bytes, tokenizer, prompt, 60, shape)}")


if __name__ == "__main__":
    main()
