"""Character vocabularies for TinyLM policies: ids 0 and 1 are PAD and EOS, then one
id per character. The text tasks and the agentic calculator each have one."""

from __future__ import annotations

from collections.abc import Sequence

PAD, EOS = 0, 1


class CharVocab:
    def __init__(self, chars: str) -> None:
        self.chars = chars
        self.tokens = ("<pad>", "<eos>", *chars)
        self._ids = {char: i for i, char in enumerate(self.tokens) if len(char) == 1}

    def __len__(self) -> int:
        return len(self.tokens)

    def unknown(self, text: str) -> str:
        """The characters of ``text`` outside the vocabulary, sorted (empty if none)."""
        return "".join(sorted(set(text) - self._ids.keys()))

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[char] for char in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: Sequence[int]) -> str:
        """Text up to the first EOS; PAD is skipped."""
        chars = []
        for i in ids:
            if i == EOS:
                break
            if i != PAD:
                chars.append(self.tokens[i])
        return "".join(chars)
