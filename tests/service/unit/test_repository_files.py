"""service/repository/files.py: the one way the service reads repository files."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelyard.service.errors import ModelLoadError
from modelyard.service.repository.files import OutsideRepository, check_tree_inside, read_inside, scrub, shown


def test_read_inside_follows_inner_links_and_refuses_outer_ones(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "m").mkdir(parents=True)
    (root / "m" / "a.txt").write_text("ours")
    (root / "m" / "link.txt").symlink_to(root / "m" / "a.txt")
    (tmp_path / "secret").write_text("theirs")
    (root / "m" / "out.txt").symlink_to(tmp_path / "secret")
    assert read_inside(root, root / "m" / "link.txt") == b"ours"
    with pytest.raises(OutsideRepository) as caught:
        read_inside(root, root / "m" / "out.txt")
    assert str(caught.value) == "m/out.txt: resolves outside the model repository"
    with pytest.raises(ModelLoadError, match=r"m/a\.txt: larger than 2 bytes"):
        read_inside(root, root / "m" / "a.txt", limit=2)
    with pytest.raises(ModelLoadError, match=r"m/none\.txt: cannot read"):
        read_inside(root, root / "m" / "none.txt")
    with pytest.raises(OutsideRepository, match=r"m/out\.txt"):
        check_tree_inside(root, root / "m")


def test_messages_name_files_relative_to_the_repository(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    root.mkdir()
    assert shown(root, root / "m" / "1" / "model.onnx") == "m/1/model.onnx"
    text = f"Load model from {root}/m/1/model.onnx failed; repository {root}"
    assert scrub(text, root) == "Load model from m/1/model.onnx failed; repository <repository>"
