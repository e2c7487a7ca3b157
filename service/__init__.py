"""Modelyard inference service: ONNX models over gRPC."""

__version__ = "0.1.0"
