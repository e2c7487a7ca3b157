"""The contracts' sources, shipped for other languages' code generators: this folder is a buf
module root (`modelyard/inference/v1/*.proto`, `modelyard/kserve/v2/*.proto`,
`modelyard/flat/v1/inference.fbs`); see docs/api.md. Installed, they are package data here (the
repository's proto/modelyard, which pyproject.toml's package-dir maps to modelyard/proto/modelyard);
in a checkout (an editable install maps packages, not data) the module root is the repository's
proto/, the files the Python code is generated from."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
ROOT = _HERE if (_HERE / "modelyard").is_dir() else _HERE.parents[1] / "proto"
