"""The model repository on disk: model configs and version folders."""
