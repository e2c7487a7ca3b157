"""ONNX Runtime sessions and the table of served model versions."""
