"""grpc.health.v1 service names: the server as a whole, and one per model."""

from __future__ import annotations

SERVER = ""  # the whole server: SERVING once it serves, NOT_SERVING while starting or stopping
MODEL_PREFIX = "models/"


def model_service_name(model: str) -> str:
    """The health service name that reports one model's readiness (SERVING while a version serves)."""
    return MODEL_PREFIX + model
