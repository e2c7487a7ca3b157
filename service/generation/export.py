"""What a Hugging Face export states beside its model.onnx: `config.json` (the context length),
`generation_config.json` (end tokens, padding, default sampling), and, failing both, the size of
the graph's own position table.

Each file is looked for beside model.onnx (one per version), else in the model's folder (shared
by its versions), like tokenizer.json; like every model file it must resolve inside the
repository and stay small (read_inside). A file that is there but is not a JSON object fails the
load: a broken export must not be served with guessed settings.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from modelyard.service.errors import ModelLoadError
from modelyard.service.repository.files import read_inside, shown

log = logging.getLogger(__name__)

CONFIG_JSON = "config.json"
GENERATION_CONFIG_JSON = "generation_config.json"
# The keys of config.json that state the context, in the spellings of the model families
# (GPT-2: n_positions / n_ctx; Llama, Mistral, Qwen2, Phi-3: max_position_embeddings; ...).
CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
)
_JSON_LIMIT = 4 << 20
# A graph is parsed a second time (weights included, unless they are external data) only to find
# its position table; beyond this size that costs more memory than a fallback is worth.
MAX_TABLE_SEARCH_BYTES = 1 << 30
# Ops that pass position ids on unchanged in value (a Gather's indices traced back through them).
_PASS_THROUGH = {"Cast", "Unsqueeze", "Squeeze", "Reshape", "Identity", "Flatten", "Expand"}


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json's values, as Hugging Face's GenerationConfig names them."""

    present: bool = False  # the export has a generation_config.json
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    # Default sampling, used for the fields a request leaves to the model (model_defaults).
    do_sample: bool | None = None  # None: not stated
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None


def find_file(model_file: Path, name: str) -> Path | None:
    """`name` beside model.onnx, else in the model's folder."""
    for folder in (model_file.parent, model_file.parent.parent):
        candidate = folder / name
        if candidate.is_file():
            return candidate
    return None


def read_json(model_file: Path, name: str) -> dict[str, Any] | None:
    """The JSON object in `name` (beside model.onnx or in the model's folder), None when absent."""
    path = find_file(model_file, name)
    return None if path is None else read_json_file(model_file.parent.parent.parent, path)


def read_json_file(root: Path, path: Path) -> dict[str, Any]:
    """The JSON object in `path`, read only once it resolves inside the repository `root`."""
    shown_name = shown(root, path)
    try:
        value = json.loads(read_inside(root, path, limit=_JSON_LIMIT).decode("utf-8"))
    except ModelLoadError:
        raise
    except (UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"{shown_name}: not JSON: {exc}", "config") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{shown_name}: expected a JSON object", "config")
    return value


def context_from_config(config: dict[str, Any] | None) -> tuple[int, str] | None:
    """config.json's context length and the key that stated it."""
    if not config:
        return None
    for key in CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, key
    return None


def position_table_size(model_file: Path) -> int | None:
    """The rows of the graph's position table: a Gather from a fixed [N, d] initializer whose
    indices are the position_ids input (or a Range, in exports that compute positions inside),
    passed through casts and reshapes. None when there is no such table (rotary models) or the
    graph cannot be read."""
    try:
        if model_file.stat().st_size > MAX_TABLE_SEARCH_BYTES:
            return None
        model = onnx.load(str(model_file), load_external_data=False)
    except Exception as exc:  # unreadable here: ONNX Runtime loaded it, so it is only a fallback lost
        log.debug("%s: no position table read: %s", model_file, exc)
        return None
    graph = model.graph
    tables = {t.name: tuple(t.dims) for t in graph.initializer if len(t.dims) == 2}
    producers = {out: node for node in graph.node for out in node.output}
    inputs = {i.name for i in graph.input}
    sizes = []
    for node in graph.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[0] not in tables:
            continue
        if any(a.name == "axis" and a.i != 0 for a in node.attribute):
            continue
        if _from_positions(node.input[1], producers, inputs):
            sizes.append(tables[node.input[0]][0])
    return min(sizes) if sizes else None


def _from_positions(name: str, producers: dict[str, onnx.NodeProto], inputs: set[str]) -> bool:
    for _ in range(16):  # a short chain of pass-through ops
        if name == "position_ids" and name in inputs:
            return True
        node = producers.get(name)
        if node is None:
            return False
        if node.op_type == "Range":
            return True
        if node.op_type not in _PASS_THROUGH or not node.input:
            return False
        name = node.input[0]
    return False


def generation_defaults(model_file: Path) -> GenerationDefaults | None:
    """generation_config.json's end tokens, padding and sampling defaults; None when absent."""
    raw = read_json(model_file, GENERATION_CONFIG_JSON)
    if raw is None:
        return None
    eos = raw.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    return GenerationDefaults(
        present=True,
        eos_token_ids=tuple(t for t in eos_ids if _token_id(t)),
        pad_token_id=raw.get("pad_token_id") if _token_id(raw.get("pad_token_id")) else None,
        bos_token_id=raw.get("bos_token_id") if _token_id(raw.get("bos_token_id")) else None,
        do_sample=raw["do_sample"] if isinstance(raw.get("do_sample"), bool) else None,
        temperature=_number(raw.get("temperature"), 0.0, 100.0),
        top_k=int(raw["top_k"]) if _token_id(raw.get("top_k")) else None,
        top_p=_number(raw.get("top_p"), 0.0, 1.0),
    )


def _token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any, low: float, high: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        return None
    return float(value)
