"""A model's chat template, rendered as Hugging Face's transformers renders it.

The template is the model's own: `chat_template.jinja` beside its tokenizer.json (it wins, as in
transformers), else `chat_template` in tokenizer_config.json (a string, or a list of named
templates: "default" is the one used). It is rendered as `tokenizer.apply_chat_template(messages,
add_generation_prompt=True, tokenize=False)` does (transformers' utils/chat_template_utils.py):
Jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols
extension and a `{% generation %}` block tag, `raise_exception`, `strftime_now` and a `tojson`
filter that does not escape HTML, and the tokenizer's special tokens (`bos_token`, `eos_token`,
...) as variables.

A template is the model owner's code, but the messages are the client's: the sandbox keeps the
template from Python's internals, and each rendering is bounded in characters (what a prompt may
hold) and in time (checked at every call the template makes and every piece it writes).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from modelyard.service.errors import InvalidInput, ModelLoadError
from modelyard.service.generation.export import read_json_file
from modelyard.service.repository.files import read_inside, shown

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# The special tokens transformers passes to a template (its special_tokens_map: in 5.x the named
# ones only).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
RENDER_TIME_LIMIT_S = 1.0
_TEMPLATE_LIMIT = 1 << 20


class _Deadline(threading.local):
    at = 0.0


class _Bounded(ImmutableSandboxedEnvironment):
    """The sandbox, with a deadline checked at every call the template makes."""

    deadline = _Deadline()

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_time(self.deadline.at)
        return super().call(__context, __obj, *args, **kwargs)


def _check_time(deadline: float) -> None:
    if deadline and time.monotonic() > deadline:
        raise jinja2.TemplateError(f"the chat template took more than {RENDER_TIME_LIMIT_S:g} s to render")


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens
    for training masks): its body renders as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' own: Jinja's built-in tojson escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """transformers' `dict` global: dict() and dict.fromkeys(), nothing of the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """transformers' `namespace`: no underscore-prefixed attributes (CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


def _environment() -> _Bounded:
    """transformers' environment (5.x), with a deadline."""
    env = _Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # the template's text
    origin: str  # where it was read (for messages)
    specials: Mapping[str, Any] = field(default_factory=dict)  # bos_token, eos_token, ...
    _template: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def compile(cls, source: str, origin: str, specials: Mapping[str, Any]) -> ChatTemplate:
        try:
            template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ModelLoadError(f"{origin}: the chat template does not compile: {exc}", "config") from None
        return cls(source, origin, dict(specials), template)

    def render(
        self,
        messages: Sequence[Mapping[str, str]],
        limit_chars: int,
        add_generation_prompt: bool = True,
        time_limit_s: float = RENDER_TIME_LIMIT_S,
    ) -> str:
        """The prompt; InvalidInput (naming `messages`) when the template refuses the conversation
        (its raise_exception), fails on it, or renders more than `limit_chars` or for too long."""
        deadline = time.monotonic() + time_limit_s
        env: _Bounded = self._template.environment
        env.deadline.at = deadline
        pieces: list[str] = []
        size = 0
        try:
            for piece in self._template.generate(
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.specials,
            ):
                size += len(piece)
                if size > limit_chars:
                    raise InvalidInput(
                        f"messages: the chat template renders more than {limit_chars} characters, more "
                        "than the model's context can hold"
                    )
                _check_time(deadline)
                pieces.append(piece)
        except InvalidInput:
            raise
        except jinja2.TemplateError as exc:
            raise InvalidInput(f"messages: the model's chat template refuses them: {exc}") from None
        except Exception as exc:  # the template's own fault on these messages (a bad index, ...)
            raise InvalidInput(
                f"messages: the model's chat template failed on them: {type(exc).__name__}: {exc}"
            ) from None
        finally:
            env.deadline.at = 0.0
        return "".join(pieces)


def load_chat_template(tokenizer_file: Path, root: Path) -> ChatTemplate | None:
    """The model's chat template (beside its tokenizer.json, in the repository `root`), None when
    it has none."""
    folder = tokenizer_file.parent
    config = _read_json(root, folder, TOKENIZER_CONFIG) or {}
    specials = _specials(config, _read_json(root, folder, SPECIAL_TOKENS_MAP) or {})
    path = folder / TEMPLATE_FILE
    if path.is_file():
        try:
            source = read_inside(root, path, limit=_TEMPLATE_LIMIT).decode("utf-8")
        except UnicodeDecodeError:
            raise ModelLoadError(f"{shown(root, path)}: not UTF-8 text", "config") from None
        return ChatTemplate.compile(source, shown(root, path), specials)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default" without tools
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None:
        return None
    origin = shown(root, folder / TOKENIZER_CONFIG)
    if not isinstance(template, str):
        raise ModelLoadError(f"{origin}: chat_template must be a string or named templates", "config")
    return ChatTemplate.compile(template, origin, specials)


def _read_json(root: Path, folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / name
    return read_json_file(root, path) if path.is_file() else None


def _token(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _specials(config: Mapping[str, Any], mapped: Mapping[str, Any]) -> dict[str, Any]:
    specials: dict[str, Any] = {}
    for name in SPECIAL_TOKENS:
        token = _token(config.get(name, mapped.get(name)))
        if token is not None:
            specials[name] = token
    return specials
