"""The contracts' sources, shipped for other languages' code generators: this folder is a buf
module root (`modelyard/inference/v1/*.proto`, `modelyard/kserve/v2/*.proto`,
`modelyard/flat/v1/inference.fbs`); see docs/api.md. `modelyard` here links to the repository's
proto/modelyard, the files the Python code is generated from."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent
