"""Class labels for outputs, as Triton reads them: the file an output's `label_filename` names,
beside the model's config, one label per line (line i labels class index i)."""

from __future__ import annotations

from pathlib import Path

from service.repository.config import ConfigError, ModelConfig

MAX_LABEL_FILE_BYTES = 16 * 1024 * 1024


def load_labels(model_dir: Path, config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each output's labels, by output name; ConfigError naming a missing or unreadable file."""
    labels: dict[str, tuple[str, ...]] = {}
    for output in config.outputs:
        if not output.label_filename:
            continue
        path = model_dir / output.label_filename
        try:
            # Symlinks are fine (Kubernetes volumes use them) while they stay in the repository.
            if not path.resolve().is_relative_to(model_dir.resolve().parent):
                raise ConfigError(f"{path}: resolves outside the model repository")
            if path.stat().st_size > MAX_LABEL_FILE_BYTES:
                raise ConfigError(f"{path}: a label file may hold at most 16 MiB")
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"outputs ({output.name}).label_filename: cannot read {path}: {exc}") from None
        labels[output.name] = tuple(text.splitlines())
    return labels
