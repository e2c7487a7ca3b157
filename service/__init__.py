"""Modelyard inference service: ONNX models over gRPC."""

# service/ installs as modelyard.service (pyproject.toml's package-dir). Under another name (its
# folder's, with the repository root on the path) it would be a second copy of the code and its state.
if __name__ != "modelyard.service":
    raise ImportError(f"{__name__}: import modelyard.service (service/ is not a package of its own)")

__version__ = "0.1.0"
