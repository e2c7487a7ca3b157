"""Chat templates rendered as Hugging Face's transformers renders them.

tests/data/chat_templates/renderings.json holds what transformers' own
`tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)` gave for each
template of templates.json (the common families' formats, one exercising Jinja's less common
features, and codelm's own template) on each conversation of conversations.json: produced once
with transformers in a throwaway virtual environment outside the project (transformers is no
dependency of modelyard); make_renderings.py.txt beside them is the script that did it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from modelyard.service.errors import InvalidInput, ModelLoadError
from modelyard.service.generation.chat import ChatTemplate, load_chat_template

DATA = Path(__file__).resolve().parents[2] / "data" / "chat_templates"
CODELM_TEMPLATE = DATA.parents[2] / "models" / "demo" / "codelm" / "1" / "chat_template.jinja"
RENDERINGS = json.loads((DATA / "renderings.json").read_text())
TEMPLATES = {**json.loads((DATA / "templates.json").read_text()), "codelm": CODELM_TEMPLATE.read_text()}
CONVERSATIONS = json.loads((DATA / "conversations.json").read_text())
CASES = RENDERINGS["cases"]


def template(name: str) -> ChatTemplate:
    return ChatTemplate.compile(TEMPLATES[name], name, RENDERINGS["specials"])


@pytest.mark.parametrize("case", CASES, ids=[f"{c['template']}-{c['conversation']}" for c in CASES])
def test_the_rendering_equals_transformers(case: dict[str, Any]) -> None:
    messages = CONVERSATIONS[case["conversation"]]
    chat = template(case["template"])
    if "error" in case:  # the template's raise_exception: refused, with the template's message
        with pytest.raises(InvalidInput, match="messages: ") as refused:
            chat.render(messages, 1 << 20)
        assert case["error"] in str(refused.value)
    else:
        assert chat.render(messages, 1 << 20) == case["rendered"]


def test_every_family_and_conversation_is_covered() -> None:
    assert {c["template"] for c in CASES} == set(TEMPLATES)
    assert len(CASES) == len(TEMPLATES) * len(CONVERSATIONS)
    assert any("error" in c for c in CASES) and sum("rendered" in c for c in CASES) >= 30


def repository(tmp_path: Path, files: dict[str, Any]) -> Path:
    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    (version / "tokenizer.json").write_text("{}")
    for name, value in files.items():
        (version / name).write_text(value if isinstance(value, str) else json.dumps(value))
    return version / "tokenizer.json"


def test_the_template_is_read_from_tokenizer_config_or_chat_template_jinja(tmp_path: Path) -> None:
    config = {"chat_template": "{{ bos_token }}{{ messages[0]['content'] }}", "bos_token": {"content": "<s>"}}
    tokenizer = repository(tmp_path, {"tokenizer_config.json": config})
    chat = load_chat_template(tokenizer, tmp_path)
    assert chat is not None and chat.render([{"role": "user", "content": "hi"}], 100) == "<s>hi"
    # A chat_template.jinja beside it wins (as in transformers); the named-list form picks "default".
    (tokenizer.parent / "chat_template.jinja").write_text("J{{ eos_token }}")
    (tokenizer.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    chat = load_chat_template(tokenizer, tmp_path)
    assert chat is not None and chat.render([], 100) == "J</s>"
    (tokenizer.parent / "chat_template.jinja").unlink()
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tokenizer.parent / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    chat = load_chat_template(tokenizer, tmp_path)
    assert chat is not None and chat.render([], 100) == "D"


def test_no_template_is_none_and_a_broken_one_fails_the_load(tmp_path: Path) -> None:
    tokenizer = repository(tmp_path, {"tokenizer_config.json": {"eos_token": "</s>"}})
    assert load_chat_template(tokenizer, tmp_path) is None
    (tokenizer.parent / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ModelLoadError, match="does not compile"):
        load_chat_template(tokenizer, tmp_path)


def test_rendering_is_bounded_in_size_and_time_and_sandboxed() -> None:
    echo = ChatTemplate.compile("{% for m in messages %}{{ m['content'] }}{% endfor %}", "t", {})
    with pytest.raises(InvalidInput, match="renders more than 100 characters"):
        echo.render([{"role": "user", "content": "x" * 60}] * 2, 100)
    assert echo.render([{"role": "user", "content": "x" * 60}], 100) == "x" * 60
    # A template that loops for long: stopped at the time limit (each call it makes is checked).
    slow = ChatTemplate.compile(
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ ''.join([]) }}{% endfor %}{% endfor %}",
        "slow",
        {},
    )
    with pytest.raises(InvalidInput, match="took more than"):
        slow.render([], 1 << 30, time_limit_s=0.2)
    escape = ChatTemplate.compile("{{ messages.__class__.__mro__ }}", "escape", {})
    with pytest.raises(InvalidInput, match="messages: "):
        escape.render([], 1000)
    namespace = ChatTemplate.compile("{% set ns = namespace(_x=1) %}{{ ns._x }}", "ns", {})
    with pytest.raises(InvalidInput, match="messages: "):
        namespace.render([], 1000)


def test_codelm_names_the_reply_after_the_request() -> None:
    codelm = template("codelm")
    later = [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        {"role": "user", "content": "42 is\nthe answer"},
    ]
    assert codelm.render(later, 1000) == (
        "# user: add\ndef add(a, b):\n    return a + b\n# user: 42 is\n# the answer\ndef f_42_is_the_answer("
    )
    assert codelm.render([{"role": "user", "content": "¿?"}], 1000) == "# user: ¿?\ndef answer("
    assert codelm.render([{"role": "assistant", "content": "x = 1"}], 1000) == "x = 1\n"
    words = "one two three four five six seven"
    assert codelm.render([{"role": "user", "content": words}], 1000).endswith(
        "def one_two_three_four_five_six("
    )
