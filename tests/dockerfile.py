"""deploy/Dockerfile read as Docker reads it (no daemon here to build it): its stages'
instructions, and the build context its `wheel` stage copies, with Dockerfile.dockerignore's
exclusions. tests/installs.py builds the wheel from exactly that copy, so the wheel the tests install
is the one the image would build; tests/deploy/unit/test_dockerfile.py checks the stages."""

from __future__ import annotations

import fnmatch
import re
import shlex
import shutil
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"


def stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions (continuations joined, comments dropped)."""
    text = re.sub(
        r"\\\n",
        " ",
        "\n".join(ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")),
    )
    found: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        word, _, rest = line.strip().partition(" ")
        if word.upper() == "FROM":
            current = [("FROM", rest)]
            found[rest.split(" AS ")[1].strip()] = current
        elif current:
            current.append((word.upper(), rest.strip()))
    return found


def copies(stage: str) -> list[tuple[str, str]]:
    """(source in the context, destination below the stage's WORKDIR) for each COPY'd path."""
    pairs = []
    for word, rest in stages()[stage]:
        if word != "COPY":
            continue
        *sources, destination = shlex.split(rest)
        into_folder = destination.endswith("/") or len(sources) > 1
        for source in sources:
            target = PurePosixPath(destination) / PurePosixPath(source).name if into_folder else destination
            pairs.append((source, str(PurePosixPath(target))))
    return pairs


def ignored_patterns() -> list[str]:
    return [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and ln[0] != "#"]


def excluded(relative: str, patterns: list[str]) -> bool:
    """Docker's rule, as far as our patterns use it: a path (or a folder above it) matches."""
    parts = PurePosixPath(relative).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        bare = pattern.removeprefix("**/")
        for candidate in candidates:
            if fnmatch.fnmatchcase(candidate, pattern) or (
                pattern.startswith("**/") and fnmatch.fnmatchcase(PurePosixPath(candidate).name, bare)
            ):
                return True
    return False


def copy_context(stage: str, destination: Path) -> None:
    """What `stage`'s COPY instructions put under its WORKDIR, put under `destination`."""
    patterns = ignored_patterns()
    for source, target in copies(stage):
        assert not excluded(source, patterns), f"{source} is excluded from the build context"
        origin, place = ROOT / source, destination / target
        place.parent.mkdir(parents=True, exist_ok=True)
        if origin.is_dir():

            def ignore(folder: str, names: list[str]) -> set[str]:
                below = Path(folder).relative_to(ROOT)
                return {n for n in names if excluded(str(below / n), patterns)}

            shutil.copytree(origin, place, symlinks=True, ignore=ignore, dirs_exist_ok=True)
        else:
            shutil.copy2(origin, place)
