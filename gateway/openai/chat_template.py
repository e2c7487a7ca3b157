"""The chat template of the demo model `codelm` (and the default for any model without one).

codelm is a small language model trained on Python source: it completes code, it does not chat.
So a conversation is written the way Python code carries prose, and the answer is a function
named after the request, which the model writes:

    # system: You write short Python functions.
    # user: add two numbers
    def add(a, b):          <- an earlier assistant message, verbatim
    # user: now subtract
    def now_subtract(       <- the answer's opening, written by the template
                            <- the model continues here (arguments, docstring, body)

System, user and other messages become comment lines (`# role: text`, each further line `# `);
assistant messages stay code. When the conversation ends with a user message, the prompt ends
with the opening `def <name>(` (the name made of the message's first words) and the answer's
content starts with that opening, so the reply reads as one function. The answer ends where the
function does: at the next top-level `def`, `class` or decorator, or two blank lines (the
template's stop sequences, used when the client sends none of its own).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "developer", "tool")
# The end of a top-level function: what follows it in a Python file.
STOP = ("\ndef ", "\nclass ", "\n@", "\n\n\n")
_NAME_WORDS = 6
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True, slots=True)
class Rendered:
    prompt: str  # what the model continues
    opening: str  # the start of the answer, written by the template ("" when none)
    stop: tuple[str, ...]  # where the answer ends, unless the client sends stop sequences


def render(messages: Sequence[dict[str, Any]]) -> Rendered:
    parts: list[str] = []
    for message in messages:
        role = message["role"]
        content = message["content"]
        if role == "assistant":
            parts.append(content if content.endswith("\n") else content + "\n")
            continue
        lines = content.splitlines() or [""]
        parts.append(f"# {role}: {lines[0]}\n" + "".join(f"# {line}\n" for line in lines[1:]))
    last = messages[-1] if messages else None
    opening = ""
    if last is not None and last["role"] == "user":
        opening = f"def {function_name(last['content'])}("
    return Rendered("".join(parts) + opening, opening, STOP)


def function_name(text: str) -> str:
    """A Python name from a message's first words: "Add two numbers!" -> add_two_numbers."""
    name = "_".join(_WORD.findall(text.lower())[:_NAME_WORDS]) or "answer"
    return "f_" + name if name[0].isdigit() else name
