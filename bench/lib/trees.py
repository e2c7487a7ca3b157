"""Source trees other than the installed one: `--trees LABEL=PATH,...` (the trees a benchmark runs
side by side, before/after pairs) and the PYTHONPATH that runs a tree's code.

A tree has no `modelyard` folder: pyproject.toml's package-dir maps its folders (common/, service/,
proto/python/inference, ...) to modelyard.*, and an editable install follows that map for the one
tree it was made from. Any other tree (a base commit's worktree for a benchmark, a git worktree run
with another checkout's virtual environment) runs through a folder of links laid out as the package
installs: `pythonpath(TREE)` makes it (or brings it up to date) under the system's temporary
folder, outside every tree, and returns what to put first on PYTHONPATH. mypy and import-linter,
which cannot follow an editable install's import hook, read the package through it too (make lint).
A tree of the layout before (proto/python/modelyard, with links in it) runs from its proto/python.

    export PYTHONPATH=$(.venv/bin/python -m bench.lib.trees --pythonpath TREE)

The folders link whole (a module added below service/ or common/process/ is seen at once); a module
added at the top of common/ is seen once this runs again. Standard library only: it runs before
the tree's own packages are on the path.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import stat
import sys
import tempfile
import tomllib
from pathlib import Path

PACKAGE = "modelyard"


def source_trees(text: str) -> list[tuple[str, Path]]:
    """LABEL=PATH,... -> [(label, resolved path)], each a source tree of either layout."""
    pairs = []
    for part in (part for part in text.split(",") if part):
        label, _, path = part.partition("=")
        if not label or not path or not is_source_tree(Path(path)):
            raise argparse.ArgumentTypeError(f"{part!r}: give LABEL=PATH of a source tree")
        pairs.append((label, Path(path).resolve()))
    return pairs


def is_source_tree(tree: Path) -> bool:
    return _old_layout(tree) or PACKAGE in package_dirs(tree)


def _old_layout(tree: Path) -> bool:
    """proto/python/modelyard, the package with the processes' folders linked into it."""
    return (tree / "proto" / "python" / PACKAGE / "__init__.py").is_file()


def package_dirs(tree: Path) -> dict[str, Path]:
    """The tree's package-dir map (pyproject.toml): package name -> its folder; {} if none."""
    try:
        project = tomllib.loads((tree / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    mapping = project.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    return {name: (tree / folder).resolve() for name, folder in mapping.items() if name}


def pythonpath(tree: Path, under: Path | None = None) -> str:
    """What to put first on PYTHONPATH to run `tree`'s modelyard (the link tree made below `under`,
    by default this user's folder under the system's temporary folder)."""
    tree = tree.resolve()
    if _old_layout(tree):
        return str(tree / "proto" / "python")
    mapping = package_dirs(tree)
    if PACKAGE not in mapping:
        raise ValueError(f"{tree}: not a source tree (no package-dir for {PACKAGE} in pyproject.toml)")
    digest = hashlib.sha256(str(tree).encode()).hexdigest()[:12]
    root = (under or _home()) / f"{tree.name}-{digest}"
    root.mkdir(parents=True, exist_ok=True)
    _sync(root, _layout(mapping))
    return str(root)


def _home() -> Path:
    """This user's folder of link trees: a tree on PYTHONPATH is code that runs, so the folder must
    be this user's alone (made 0700; one that another user owns or may write to is refused)."""
    home = Path(tempfile.gettempdir()) / f"modelyard-trees-{os.getuid()}"
    home.mkdir(mode=0o700, exist_ok=True)
    info = home.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{home}: not a private folder of this user's")
    return home


# A folder of the link tree: its entries, each a link (to a file or a folder) or a folder of its own.
Layout = dict[str, "Path | Layout"]


def _layout(mapping: dict[str, Path]) -> Layout:
    """The installed layout: each package's folder linked whole where it is its parent's subfolder
    of the same name (as service/api is modelyard.service.api); a package with a subpackage mapped
    elsewhere (modelyard itself) becomes a folder of links to its own entries and those."""
    top: Layout = {}
    for name in sorted(mapping, key=lambda n: n.count(".")):
        *parents, last = name.split(".")
        folder: Layout = top
        for i, part in enumerate(parents):
            entry = folder.get(part)
            if isinstance(entry, Path):
                if entry.joinpath(*parents[i + 1 :], last) == mapping[name]:
                    break  # where the link of a folder above already has it
                entry = _entries(entry)  # linked whole so far: now a folder of links to its entries
                folder[part] = entry
            elif entry is None:
                raise ValueError(f"{name}: its parent {'.'.join(parents[: i + 1])} has no folder")
            folder = entry
        else:
            folder[last] = mapping[name]
    return top


def _entries(source: Path) -> Layout:
    return {p.name: p for p in sorted(source.iterdir()) if p.name != "__pycache__"}


def _sync(folder: Path, layout: Layout) -> None:
    """Make `folder` hold `layout`, in place: each link replaced atomically, stale entries removed,
    Python's own __pycache__ kept. Safe to run while a process imports from it, and concurrently."""
    for name, want in layout.items():
        path = folder / name
        if isinstance(want, Path):
            if path.is_symlink() and Path(os.readlink(path)) == want:
                continue
            if path.is_dir() and not path.is_symlink():
                _remove(path)
            spare = folder / f".{name}.{os.getpid()}"
            spare.unlink(missing_ok=True)
            spare.symlink_to(want, target_is_directory=want.is_dir())
            os.replace(spare, path)
        else:
            if path.is_symlink() or path.is_file():
                path.unlink()
            path.mkdir(exist_ok=True)
            _sync(path, want)
    for stale in folder.iterdir():
        if stale.name not in layout and stale.name != "__pycache__" and not stale.name.startswith("."):
            _remove(stale)


def _remove(path: Path) -> None:
    """An entry of a link tree: a link (never followed) or a folder of links."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    for entry in path.iterdir():
        _remove(entry)
    path.rmdir()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lib.trees", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pythonpath", metavar="TREE", type=Path, required=True, help="print its PYTHONPATH")
    args = parser.parse_args(argv)
    if not is_source_tree(args.pythonpath):
        parser.error(f"{args.pythonpath}: not a source tree of modelyard")
    print(pythonpath(args.pythonpath))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
