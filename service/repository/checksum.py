"""Optional per-version checksums: `model.onnx.sha256` beside the model must match its bytes."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from service.errors import ModelLoadError

_HEX = re.compile(r"^([0-9a-fA-F]{64})\b")
_CHUNK = 1 << 20


def checksum_file(model_file: Path) -> Path:
    return model_file.with_name(model_file.name + ".sha256")


def verify_checksum(model_file: Path) -> None:
    """Raise ModelLoadError (kind "checksum") when a checksum file exists and does not match.
    Accepts a bare digest or `sha256sum` output ("<digest>  model.onnx"). Blocking: run it in an
    executor."""
    sums = checksum_file(model_file)
    if not sums.exists():
        return
    match = _HEX.match(sums.read_text(encoding="ascii", errors="replace").strip())
    if match is None:
        raise ModelLoadError(f"{sums}: not a sha256 digest", "checksum")
    digest = hashlib.sha256()
    with model_file.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    expected = match.group(1).lower()
    if digest.hexdigest() != expected:
        raise ModelLoadError(
            f"{model_file}: sha256 {digest.hexdigest()} does not match {sums.name} ({expected})",
            "checksum",
        )
