"""Class labels for outputs, as Triton reads them: the file an output's `label_filename` names,
beside the model's config, one label per line (line i labels class index i)."""

from __future__ import annotations

from pathlib import Path

from modelyard.service.errors import ModelLoadError
from modelyard.service.repository.files import read_inside, shown
from modelyard.service.repository.model_config import ConfigError, ModelConfig

MAX_LABEL_FILE_BYTES = 16 * 1024 * 1024


def load_labels(model_dir: Path, config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each output's labels, by output name; ConfigError naming a missing or unreadable file."""
    labels: dict[str, tuple[str, ...]] = {}
    for output in config.outputs:
        if not output.label_filename:
            continue
        path = model_dir / output.label_filename
        # Symlinks are fine (Kubernetes volumes use them) while they stay in the repository: the
        # file is opened only once it resolves inside it, and its content is never quoted.
        try:
            text = read_inside(model_dir.parent, path, limit=MAX_LABEL_FILE_BYTES).decode("utf-8")
        except ModelLoadError as exc:
            raise ConfigError(f"outputs ({output.name}).label_filename: {exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(
                f"outputs ({output.name}).label_filename: {shown(model_dir.parent, path)} is not UTF-8 text"
            ) from None
        labels[output.name] = tuple(text.splitlines())
    return labels
