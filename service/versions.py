"""Version numbers as requests and version folders spell them: `3` or `v3`.

One rule for both, here rather than in the repository code, so that the served table (which
knows nothing of the repository) parses a request's version the way folders are named."""

from __future__ import annotations

import re

_VERSION = re.compile(r"v?([0-9]{1,9})")  # fullmatch: no trailing newline slips through


def parse_version(text: str) -> int | None:
    """`3` or `v3` -> 3; anything else -> None."""
    match = _VERSION.fullmatch(text)
    return int(match.group(1)) if match else None
