"""The chat template of the demo model `codelm` (and the default for any model without one).

codelm is a small language model trained on Python source, so a conversation is written the way
Python code carries prose: system and user messages become comment lines, assistant messages stay
code, and the prompt ends where the assistant's code begins:

    # system: You write short Python functions.
    # user: add two numbers
    def add(a, b):          <- an earlier assistant message, verbatim
    # user: now subtract
    <the model continues here>

Each line of a system/user message gets its own `# ` prefix (a multi-line message stays a comment);
`tool`/other roles are written as comments under their role name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "developer", "tool")


def render(messages: Sequence[dict[str, Any]]) -> str:
    parts: list[str] = []
    for message in messages:
        role = message["role"]
        content = message["content"]
        if role == "assistant":
            parts.append(content if content.endswith("\n") else content + "\n")
            continue
        lines = content.splitlines() or [""]
        parts.append(f"# {role}: {lines[0]}\n" + "".join(f"# {line}\n" for line in lines[1:]))
    return "".join(parts)
