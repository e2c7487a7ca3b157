"""Modelyard inference service: ONNX models over gRPC."""
