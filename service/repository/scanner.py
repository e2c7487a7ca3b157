"""Read the repository tree: which models exist and which version folders each holds.

Layout: `<root>/<model>/<version>/model.onnx`, version folders named `3` or `v3`, plus an optional
`<root>/<model>/config.yaml`. Nothing here loads a model; it only says what is on disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from modelyard.common.names import echo, is_valid_name
from modelyard.service.errors import ModelLoadError
from modelyard.service.repository.files import is_inside, shown
from modelyard.service.versions import parse_version

MODEL_FILE = "model.onnx"


@dataclass(frozen=True)
class ModelSource:
    """One model folder: its version folders and the problems found while reading them."""

    name: str
    path: Path
    versions: dict[int, Path] = field(default_factory=dict)  # version -> model.onnx
    problems: tuple[str, ...] = ()  # folder-level problems, e.g. "1" and "v1" both present
    # Every version folder, model file or not: an ensemble's versions are empty folders (as
    # Triton's), version -> <folder>/model.onnx all the same (a path that need not exist).
    folders: dict[int, Path] = field(default_factory=dict)


def is_model_name(text: str) -> bool:
    """The one name rule (modelyard.common.names): a folder named otherwise is no model."""
    return is_valid_name(text)


def scan_repository(root: Path, skipped: set[str] | None = None) -> dict[str, ModelSource]:
    """Every model folder under root, by name. Hidden folders (`.git`, Kubernetes' `..data`) are
    not models; other folders whose names break the name rule are skipped too, and their names
    added to `skipped` (for the caller to report)."""
    if not root.is_dir():
        raise ModelLoadError(f"model repository {root} is not a directory")
    models = {}
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        if is_valid_name(entry.name):
            models[entry.name] = scan_model(root, entry.name)
        elif skipped is not None and not entry.name.startswith("."):
            skipped.add(entry.name)
    return models


def scan_model(root: Path, name: str) -> ModelSource:
    if not is_valid_name(name):
        raise ModelLoadError(f"{echo(name)} is not a valid model name")
    path = root / name
    if not path.is_dir():
        raise ModelLoadError(f"model {name!r} is not in the repository")
    versions: dict[int, Path] = {}
    folders: dict[int, Path] = {}
    problems = []
    for entry in sorted(path.iterdir()):
        version = parse_version(entry.name)
        if version is None or not entry.is_dir():
            continue
        if is_inside(root, entry):
            folders.setdefault(version, entry / MODEL_FILE)
        model_file = entry / MODEL_FILE
        if not model_file.is_file():
            continue  # an empty or half-written version folder is not a version yet
        # Symlinks are fine (Kubernetes volumes use them) as long as they stay inside the repository.
        if not is_inside(root, model_file):
            problems.append(f"{shown(root, model_file)}: resolves outside the model repository")
            continue
        if version in versions:
            problems.append(
                f"{name}: version {version} is present twice ({versions[version].parent.name}"
                f" and {entry.name})"
            )
            continue
        versions[version] = model_file
    return ModelSource(name, path, versions, tuple(problems), folders)


def fingerprint(model_file: Path, beside: Sequence[Path] = ()) -> tuple[object, ...]:
    """What identifies the bytes of a version without reading them: the resolved file (a Kubernetes
    `..data` swap changes it), its inode, size and mtime, the checksum file's, and those of the
    files `beside` the versions that a version loads too (its outputs' label files)."""
    parts: list[object] = []
    for path in (model_file, model_file.with_name(model_file.name + ".sha256"), *beside):
        try:
            st = path.stat()
        except FileNotFoundError:
            parts.append(None)
            continue
        parts.append((str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(parts)


def version_bytes(model_file: Path) -> int:
    """Bytes on disk of a version folder (the model and any external data): its memory estimate."""
    return sum(p.stat().st_size for p in model_file.parent.rglob("*") if p.is_file())
