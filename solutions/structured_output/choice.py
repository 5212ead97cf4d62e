"""A grammar for `choice` written by hand: the output must be exactly one of a few strings.

Not a lookup of each choice's token ids: the tokenizer writes "Paris" as one token, but the model may produce
"Par" + "is", and several tokens can cover the same bytes. So the state is the *text* produced so far: the next
token may be any token whose bytes keep the output a prefix of some choice; EOS is allowed when it equals one, and
the output is complete when no choice extends it. The text is kept as UTF-8 bytes, as llguidance and xgrammar keep
theirs: SmolLM2 has tokens holding part of a character ("東京" is four of them).

Where this lives in vLLM: vLLM compiles a choice list into a grammar for its backend (`choice_as_grammar` in
`vllm/v1/structured_output/utils.py`, used by `backend_xgrammar.py`; a Lark alternation in `backend_guidance.py`).
"""

import functools
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from solutions.structured_output.bitmask import pack_token_bitmask


@functools.cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: each character of a byte-level BPE token stands for one byte.

    The 188 printable bytes stand for themselves; the other 68 (controls, space, ...) are written as the
    characters 256, 257, ... in byte order, so a token's string never holds a space or a control character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


@dataclass(frozen=True)
class TokenTexts:
    """Each token id's bytes (b"" for special tokens) and the ids of each byte string: built once per tokenizer."""

    texts: list[bytes]
    ids_by_text: dict[bytes, list[int]]
    eos_token_id: int | None

    @classmethod
    def from_tokenizer(
        cls, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_id: int | None
    ) -> "TokenTexts":
        """From a byte-level BPE tokenizer (GPT-2's alphabet, as SmolLM2's); ValueError for any other kind."""
        decoder = byte_decoder()
        special = {token_id for token_id, added in tokenizer.added_tokens_decoder.items() if added.special}
        texts: list[bytes] = []
        for token_id, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(vocab_size)))):
            if token is None or token_id in special:
                texts.append(b"")  # special tokens spell nothing
            elif set(token) <= decoder.keys():
                texts.append(bytes(map(decoder.__getitem__, token)))
            else:
                raise ValueError(f"TokenTexts needs a byte-level BPE tokenizer: token {token_id} is {token!r}, which "
                                 "is not written in GPT-2's byte alphabet")
        ids_by_text: dict[bytes, list[int]] = {}
        for token_id, text in enumerate(texts):
            if text:
                ids_by_text.setdefault(text, []).append(token_id)
        return cls(texts, ids_by_text, eos_token_id)


class ChoiceGrammar:
    """The output is exactly one of `choices` (a `StructuredOutputGrammar`; see the module docstring)."""

    def __init__(self, choices: list[str], tokens: TokenTexts) -> None:
        self.choices = [choice.encode() for choice in choices]  # compared as UTF-8 bytes, as the tokens are
        self.tokens = tokens
        self.text = b""  # the output so far: always a prefix of some choice
        self.ended = False  # the end-of-sequence token was accepted

    def allowed_token_ids(self) -> list[int]:
        """Every token that keeps the output a prefix of some choice, and EOS once it is a whole choice."""
        if self.ended:
            return []
        allowed = set()
        for choice in self.choices:
            if choice.startswith(self.text):
                rest = choice[len(self.text) :]
                for end in range(1, len(rest) + 1):  # each token that spells the next `end` bytes
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
