"""The demo model repository as package data: `modelyard demo-models DIR` copies it out, so an
installed service has models to try without this checkout (the wheel's `repository` is
models/demo, mapped by pyproject.toml's package-dir).

Shipped built rather than as its builders (models/demo_models.py): the builders would need onnx at
run time and still could not make the trained language model (codelm, 4.3 MB of the 4.4 MB;
models/train_demo_lm.py needs torch and minutes), so the built files are the smaller and the only
complete choice."""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

# A checkout's own (common/demo/ -> the repository root): an editable install maps packages, not
# data, so there the demo repository is where it is kept, models/demo.
_CHECKOUT = Path(__file__).resolve().parents[2] / "models" / "demo"


def repository() -> Path:
    """The installed demo repository (a folder inside the installed package), else a checkout's."""
    installed = Path(str(resources.files(__name__) / "repository"))
    return installed if installed.is_dir() else _CHECKOUT


def copy_to(target: Path) -> list[str]:
    """Copy the demo repository into `target` (made if missing; an existing model folder of the same
    name is refused, not overwritten). Returns the model names written."""
    source = repository()
    models = sorted(p.name for p in source.iterdir() if p.is_dir())
    if not models:
        raise FileNotFoundError(f"no demo models in {source} (an install without its package data?)")
    clashes = [name for name in models if (target / name).exists()]
    if clashes:
        raise FileExistsError(f"{target} already has {', '.join(clashes)}")
    target.mkdir(parents=True, exist_ok=True)
    for name in models:
        shutil.copytree(source / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
    return models
