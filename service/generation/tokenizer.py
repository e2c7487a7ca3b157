"""A model version's tokenizer (`tokenizer.json`, the Hugging Face `tokenizers` format)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from modelyard.service.errors import ModelLoadError
from modelyard.service.repository.files import is_inside, read_inside, shown

TOKENIZER_FILE = "tokenizer.json"
# End-of-text tokens of the common tokenizer families, tried in order when the config names none.
KNOWN_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")


class TokenizerError(Exception):
    """tokenizer.json cannot be read, or the configured end-of-text token is not in it."""


class TextCodec:
    """Text <-> token ids. Thread-safe for encode/decode (the Rust tokenizer takes no Python state)."""

    def __init__(self, tokenizer: Tokenizer, eos_token: str = "", eos_ids: Sequence[int] = ()) -> None:
        """`eos_token`: config.yaml's end-of-text token (it wins); `eos_ids`: the export's own end
        tokens (generation_config.json's eos_token_id, a list in many chat models); with neither,
        the tokenizer's known end-of-text token."""
        self._tokenizer = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_ids: frozenset[int] = self._eos_ids(eos_token, eos_ids)

    def is_eos(self, token: int) -> bool:
        return token in self.eos_ids

    @classmethod
    def from_file(
        cls, path: Path, eos_token: str = "", root: Path | None = None, eos_ids: Sequence[int] = ()
    ) -> TextCodec:
        """The tokenizer in `path`, read only once it resolves inside the repository `root`
        (default: <root>/<model>/<version>/tokenizer.json's root)."""
        root = path.parent.parent.parent if root is None else root
        name = shown(root, path)
        try:
            text = read_inside(root, path, limit=256 << 20).decode("utf-8")
            tokenizer = Tokenizer.from_str(text)
        except ModelLoadError as exc:
            raise TokenizerError(str(exc)) from None
        except UnicodeDecodeError:
            raise TokenizerError(f"{name}: not UTF-8 text") from None
        except Exception as exc:  # the Rust side raises a bare Exception for any parse error
            raise TokenizerError(f"{name}: not a tokenizers tokenizer.json: {exc}") from None
        try:
            return cls(tokenizer, eos_token, eos_ids)
        except TokenizerError as exc:
            raise TokenizerError(f"{name}: {exc}") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        # Special tokens (the end-of-text token) are markers, not text.
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

    def token_text(self, token: int) -> str:
        """One token's text as logprobs show it: special tokens as written (`</s>`)."""
        return str(self._tokenizer.decode([token], skip_special_tokens=False))

    def token_id(self, token: str) -> int | None:
        found = self._tokenizer.token_to_id(token)
        return None if found is None else int(found)

    def _eos_ids(self, configured: str, exported: Sequence[int]) -> frozenset[int]:
        if configured:
            token_id = self._tokenizer.token_to_id(configured)
            if token_id is None:
                raise TokenizerError(f"generation.eos_token {configured!r} is not a token of the tokenizer")
            return frozenset({int(token_id)})
        if exported:
            return frozenset(int(t) for t in exported)
        for name in KNOWN_EOS:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return frozenset({int(token_id)})
        return frozenset()  # generation then ends by length or stop sequence only


def find_tokenizer(model_file: Path) -> Path | None:
    """tokenizer.json beside model.onnx (one per version), else in the model's folder (shared).
    Like model files, it must not resolve outside the repository (<root>/<model>/<version>/)."""
    root = model_file.parent.parent.parent
    for folder in (model_file.parent, model_file.parent.parent):
        candidate = folder / TOKENIZER_FILE
        if candidate.is_file():
            if not is_inside(root, candidate):
                raise TokenizerError(f"{shown(root, candidate)}: resolves outside the model repository")
            return candidate
    return None
