"""Reading only what is ours: every file the service reads from the repository goes through here.

A file (or any folder above it) may be a symlink, as Kubernetes volumes make them, but what it
resolves to must lie inside the repository; otherwise it is refused before it is opened, so that
nothing outside the repository (its bytes, or a parser's error quoting them) reaches a client.
Messages name files relative to the repository, never by the server's absolute paths.
"""

from __future__ import annotations

import os
from pathlib import Path

from modelyard.service.errors import ModelLoadError


class OutsideRepository(ModelLoadError):
    """A file of the repository resolves to a place outside it."""

    def __init__(self, shown: str) -> None:
        super().__init__(f"{shown}: resolves outside the model repository", "outside")


def resolve_inside(root: Path, path: Path) -> Path:
    """The file `path` resolves to, after checking that it lies inside `root` (which may itself be
    a symlink); raise OutsideRepository otherwise."""
    real = path.resolve()
    if not real.is_relative_to(root.resolve()):
        raise OutsideRepository(shown(root, path))
    return real


def is_inside(root: Path, path: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def check_tree_inside(root: Path, folder: Path) -> None:
    """Raise OutsideRepository for the first file or folder under `folder` (a version folder) that
    resolves outside `root`: ONNX Runtime opens a model's external data files itself, checking
    their names but not where their symlinks lead."""
    for path in sorted(folder.rglob("*")):
        resolve_inside(root, path)


def read_inside(root: Path, path: Path, limit: int = 64 << 20) -> bytes:
    """The bytes of `path`, opened only once it resolves inside `root`. The resolved path is what
    is opened (with O_NOFOLLOW), so a symlink swapped in between the check and the open is refused
    rather than followed. Files above `limit` bytes are refused: configs and tokenizers are small."""
    real = resolve_inside(root, path)
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ModelLoadError(f"{shown(root, path)}: cannot read: {exc.strerror}", "read") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ModelLoadError(f"{shown(root, path)}: larger than {limit} bytes", "read")
    return data


def shown(root: Path, path: Path) -> str:
    """How messages name `path`: relative to the repository (absolute paths are the server's)."""
    for base in (root, root.resolve()):
        try:
            return str(path.relative_to(base))
        except ValueError:
            continue
    return path.name


def scrub(text: str, root: Path) -> str:
    """`text` (an error from us or from ONNX Runtime) with the repository's absolute path taken
    out, so that status reasons sent to clients name files relative to the repository."""
    for base in sorted({str(root), str(root.resolve()), str(root.absolute())}, key=len, reverse=True):
        text = text.replace(base.rstrip("/") + "/", "").replace(base, "<repository>")
    return text
