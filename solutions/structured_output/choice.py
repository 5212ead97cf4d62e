"""A grammar for `choice` written by hand: the output must be exactly one of a few strings.

Why this is not a lookup of each choice's token ids. The tokenizer would write "Paris" as one token, but the
model may well produce "Par" + "is", or " Paris" with its space glued on, and every one of those paths spells a
valid answer. A token is a string of characters, and several tokens can cover the same characters. So the state
is the *text* produced so far, not a position in one tokenisation: the next token may be any token whose text
keeps the output a prefix of some choice. When the text equals a choice, the end-of-sequence token is allowed
too; when no choice extends it any further, the output is complete.

Tokens are matched by their decoded text, so a token that holds only part of a UTF-8 character (byte-level BPE
has them) never matches: a choice with non-ASCII characters is still reachable through whole-character tokens,
but not through every path a byte-level grammar engine would allow. Libraries such as llguidance and xgrammar
work on bytes for that reason; this matcher stays small enough to read.

Where this lives in vLLM: vLLM compiles a choice list into a grammar for its backend (`choice_as_grammar` in
`vllm/v1/structured_output/utils.py`, used by `backend_xgrammar.py`; a Lark alternation in `backend_guidance.py`).
"""

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from solutions.structured_output.bitmask import pack_token_bitmask


@dataclass(frozen=True)
class TokenTexts:
    """Each token id's text ("" for special tokens) and the ids of each text: built once per tokenizer."""

    texts: list[str]
    ids_by_text: dict[str, list[int]]
    eos_token_id: int | None

    @classmethod
    def from_tokenizer(
        cls, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_id: int | None
    ) -> "TokenTexts":
        texts = tokenizer.batch_decode([[i] for i in range(vocab_size)], skip_special_tokens=True)
        ids_by_text: dict[str, list[int]] = {}
        for token_id, text in enumerate(texts):
            if text and "\ufffd" not in text:  # empty (special) and partial-character tokens spell nothing
                ids_by_text.setdefault(text, []).append(token_id)
        return cls(texts, ids_by_text, eos_token_id)


class ChoiceGrammar:
    """The output is exactly one of `choices` (a `StructuredOutputGrammar`; see the module docstring)."""

    def __init__(self, choices: list[str], tokens: TokenTexts) -> None:
        self.choices = list(choices)
        self.tokens = tokens
        self.text = ""  # the output so far: always a prefix of some choice
        self.ended = False  # the end-of-sequence token was accepted

    def allowed_token_ids(self) -> list[int]:
        """Every token that keeps the output a prefix of some choice, and EOS once it is a whole choice."""
        if self.ended:
            return []
        allowed = set()
        for choice in self.choices:
            if choice.startswith(self.text):
                rest = choice[len(self.text) :]
                for end in range(1, len(rest) + 1):  # each token that spells the next `end` characters
                    allowed.update(self.tokens.ids_by_text.get(rest[:end], []))
        if self.text in self.choices and self.tokens.eos_token_id is not None:
            allowed.add(self.tokens.eos_token_id)
        return sorted(allowed)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for token_id in token_ids:
            if self.ended:
                return False
            if token_id == self.tokens.eos_token_id:
                if self.text not in self.choices:
                    return False
                self.ended = True
                continue
            text = self.text + self.tokens.texts[token_id]
            if text == self.text or not any(choice.startswith(text) for choice in self.choices):
                return False
            self.text = text
        return True

    def is_terminated(self) -> bool:
        """EOS was taken, or the text is a choice that no longer choice extends."""
        return self.ended or (self.text in self.choices and not any(
            len(choice) > len(self.text) and choice.startswith(self.text) for choice in self.choices
        ))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = pack_token_bitmask(self.allowed_token_ids(), bitmask.shape[1])
