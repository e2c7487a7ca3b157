"""`python -m modelyard.deploy.requirements EXTRA [--cpu]`: the installed modelyard's requirements
for EXTRA on this platform, one per line, for `pip install -r`; with `--cpu`, plain `onnxruntime`
in place of `onnxruntime-gpu` at the same pinned version.

Why: the `service` extra's markers pick onnxruntime-gpu on Linux x86_64, and pip has no way to
leave one requirement out, so deploy/Dockerfile's CPU stage installs the wheel without its
dependencies and then these. Markers are evaluated by `packaging` (pip's own copy where the
image has no other), so the choice is the one pip would make.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare image: pip vendors the same library
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[assignment]

GPU, CPU = "onnxruntime-gpu", "onnxruntime"


def requirements(extra: str, cpu: bool, distribution: str = "modelyard") -> list[str]:
    """What `pip install 'modelyard[EXTRA]'` would install directly, here; CPU ONNX Runtime if `cpu`."""
    chosen: list[str] = []
    for line in importlib.metadata.requires(distribution) or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is not None and not marker.evaluate({"extra": extra}):
            continue
        # The platform's choice made by pip's rules, now written without its marker.
        requirement.marker = None
        if cpu and requirement.name == GPU:
            requirement.name = CPU
            requirement.extras = set()
        chosen.append(str(requirement))
    return sorted(set(chosen))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m modelyard.deploy.requirements", description=__doc__)
    parser.add_argument("extra", help="the extra: service, sidecar, gateway, client")
    parser.add_argument("--cpu", action="store_true", help="plain onnxruntime instead of onnxruntime-gpu")
    args = parser.parse_args(argv)
    print("\n".join(requirements(args.extra, args.cpu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
