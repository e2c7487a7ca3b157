"""Model files sent with a load request (Triton's `file:<path>` parameters), written into a private
folder that this module creates and owns, laid out as a repository holding that one model.

A path is taken only when it is plain: relative, '/'-separated, each part a name by the one name
rule (modelyard.common.names: no '.', '..', NUL, hidden or empty part, no absolute path), the first
part a version folder (`1/model.onnx`, `1/weights.bin`) or a file beside the versions (a labels
file). The model's name meets the same rule before it becomes the folder's name, so nothing is
written outside the folder; files are created new (O_EXCL, no symlink followed).

Every model name can hold one upload (until it is loaded again or unloaded), so the bytes of all
uploads on disk together are bounded (UploadSpace, `--max-upload-bytes`): one client with the
management credential cannot fill the disk by loading many names.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from modelyard.common.names import InvalidName, check_name, echo, is_valid_name
from modelyard.service.errors import InvalidInput, TooLarge
from modelyard.service.repository.scanner import MODEL_FILE
from modelyard.service.versions import parse_version

_RESERVED = {"config.yaml", "config.pbtxt"}  # the config travels in the `config` parameter
MAX_DEPTH = 4


class UploadSpace:
    """The bytes that uploads may hold on disk together; 0: no limit. Thread-safe: uploads are
    written and removed in executors."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, size: int, name: str) -> None:
        with self._lock:
            if self.limit and self.used + size > self.limit:
                raise TooLarge(
                    f"load of {echo(name)}: its files ({size} bytes) do not fit in the space left for "
                    f"uploaded models ({max(self.limit - self.used, 0)} of {self.limit} bytes, "
                    "--max-upload-bytes); unload models loaded with files first"
                )
            self.used += size

    def give_back(self, size: int) -> None:
        with self._lock:
            self.used -= size


@dataclass
class Upload:
    """A private repository root holding the model `name`; remove() deletes it and gives its
    bytes back to the space they were taken from (once)."""

    root: Path
    name: str
    size: int = 0
    space: UploadSpace | None = None

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        if self.space is not None:
            self.space.give_back(self.size)
            self.space = None


def check_paths(files: Mapping[str, bytes]) -> dict[tuple[str, ...], bytes]:
    """The files by their validated relative path parts; InvalidInput naming a bad one."""
    checked: dict[tuple[str, ...], bytes] = {}
    for path, data in files.items():
        parts = tuple(path.split("/"))
        where = f"load parameter {echo('file:' + path)}"
        if not path or len(parts) > MAX_DEPTH or not all(is_valid_name(p) for p in parts):
            raise InvalidInput(
                f"{where}: the path must be relative, '/'-separated plain names (e.g. 1/model.onnx)"
            )
        if len(parts) == 1 and parts[0] in _RESERVED:
            raise InvalidInput(f"{where}: give the configuration in the 'config' parameter")
        if len(parts) > 1 and parse_version(parts[0]) is None:
            raise InvalidInput(f"{where}: folders must be version folders ('1', '2', ...)")
        checked[parts] = data
    if not any(len(p) == 2 and p[1] == MODEL_FILE for p in checked):
        raise InvalidInput(f"load parameter 'file:...': no '<version>/{MODEL_FILE}' among the files")
    return checked


def write_upload(
    base: Path | None, name: str, files: Mapping[str, bytes], space: UploadSpace | None = None
) -> Upload:
    """Write the files under a new private folder (mode 0700) in `base` (default: the system's
    temporary folder), their bytes taken from `space` first (TooLarge when they do not fit).
    Blocking: run it in an executor."""
    try:
        check_name(name)  # the API checked it too; here it becomes a folder's name
    except InvalidName as exc:
        raise InvalidInput(str(exc)) from None
    checked = check_paths(files)
    size = sum(len(data) for data in checked.values())
    if space is not None:
        space.take(size, name)
    try:
        root = Path(tempfile.mkdtemp(prefix="modelyard-load-", dir=base))
    except BaseException:
        if space is not None:
            space.give_back(size)
        raise
    upload = Upload(root, name, size, space)
    try:
        model_dir = root / name
        if model_dir.parent != root or model_dir.name != name:  # a valid name is one plain part
            raise InvalidInput(f"model_name {echo(name)} is not a plain folder name")
        model_dir.mkdir()
        for parts, data in checked.items():
            target = model_dir.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
    except BaseException:
        upload.remove()
        raise
    return upload
