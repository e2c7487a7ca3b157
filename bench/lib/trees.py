"""`--trees LABEL=PATH,...`: the source trees a benchmark runs side by side (before/after pairs)."""

from __future__ import annotations

import argparse
from pathlib import Path


def source_trees(text: str) -> list[tuple[str, Path]]:
    """LABEL=PATH,... -> [(label, resolved path)], each a source tree (its proto/python/modelyard)."""
    pairs = []
    for part in (part for part in text.split(",") if part):
        label, _, path = part.partition("=")
        if not label or not path or not (Path(path) / "proto" / "python" / "modelyard").is_dir():
            raise argparse.ArgumentTypeError(f"{part!r}: give LABEL=PATH of a source tree")
        pairs.append((label, Path(path).resolve()))
    return pairs
