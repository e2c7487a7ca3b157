"""Optional per-version checksums: `model.onnx.sha256` beside the model must match its bytes."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from modelyard.service.errors import ModelLoadError
from modelyard.service.repository.files import read_inside, resolve_inside, shown

_HEX = re.compile(r"^([0-9a-fA-F]{64})\b")
_CHUNK = 1 << 20


def checksum_file(model_file: Path) -> Path:
    return model_file.with_name(model_file.name + ".sha256")


def verify_checksum(model_file: Path, root: Path | None = None) -> None:
    """Raise ModelLoadError (kind "checksum") when a checksum file exists and does not match.
    Accepts a bare digest or `sha256sum` output ("<digest>  model.onnx"). Blocking: run it in an
    executor."""
    root = model_file.parent.parent.parent if root is None else root  # <root>/<model>/<version>/
    sums = checksum_file(model_file)
    if not sums.exists():
        return
    # Read only once it resolves inside the repository, and never quoted back: only its name is.
    text = read_inside(root, sums, limit=4096).decode("ascii", errors="replace")
    match = _HEX.match(text.strip())
    if match is None:
        raise ModelLoadError(f"{shown(root, sums)}: not a sha256 digest", "checksum")
    resolve_inside(root, model_file)
    digest = hashlib.sha256()
    with model_file.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    expected = match.group(1).lower()
    if digest.hexdigest() != expected:
        raise ModelLoadError(
            f"{shown(root, model_file)}: sha256 {digest.hexdigest()} does not match {sums.name} ({expected})",
            "checksum",
        )
