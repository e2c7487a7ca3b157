"""What tritonclient 2.41's shared-memory helpers need of pkg_resources, which setuptools no longer
ships (tritonclient 2.73 no longer imports it): a package resource's file name. Put on the path of
the example clients only (tests/triton/integration/test_triton_examples.py); not Triton's code."""

from __future__ import annotations

import importlib.resources


def resource_filename(package: str, resource: str) -> str:
    return str(importlib.resources.files(package) / resource)
