"""Plausible wrong answers to chapter 08's exercises; each must fail at least one test of its exercise.

Class exercises are mutated by subclassing the reference and overriding the method that goes wrong.
"""

from concurrent.futures import Executor, Future

import torch

from solutions.core.sched.output import SchedulerOutput, sampling_rows
from solutions.structured_output.bitmask import (
    _BYTE_TO_LOGIT_TERMS,
    allocate_token_bitmask,
    pack_token_bitmask,
    unpack_token_bitmask,
)
from solutions.structured_output.choice import ChoiceGrammar, TokenTexts

# --- pack_token_bitmask --------------------------------------------------------------------------------------------


def _pack(token_ids: list[int], num_words: int, *, word_of=lambda i: i // 32, bit_of=lambda i: i % 32,
          distinct: bool = True) -> torch.Tensor:
    """The reference's packing, with switches for what the mutants below get wrong."""
    words = torch.zeros(num_words, dtype=torch.int64)
    ids = torch.tensor(sorted(set(token_ids)) if distinct else list(token_ids), dtype=torch.int64)
    words.index_add_(0, word_of(ids), 1 << bit_of(ids))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_token_bitmask_msb_first(token_ids: list[int], num_words: int) -> torch.Tensor:
    """Numbers the bits of a word from the most significant end: token 32w + j at bit 31 - j."""
    return _pack(token_ids, num_words, bit_of=lambda i: 31 - i % 32)


def pack_token_bitmask_adds_repeats(token_ids: list[int], num_words: int) -> torch.Tensor:
    """Adds each id's bit without making the ids a set: a repeated id adds its bit twice, which carries into the
    next bit (the next token)."""
    return _pack(token_ids, num_words, distinct=False)


def pack_token_bitmask_31_per_word(token_ids: list[int], num_words: int) -> torch.Tensor:
    """Counts 31 tokens per word (the sign bit left out): token i at bit i % 31 of word i // 31."""
    return _pack(token_ids, num_words, word_of=lambda i: i // 31, bit_of=lambda i: i % 31)


def pack_token_bitmask_overflows_int32(token_ids: list[int], num_words: int) -> torch.Tensor:
    """Builds the words as Python integers and hands them to torch as int32: a word with bit 31 set is 2**31 or
    more, which int32 cannot hold (torch raises)."""
    words = [0] * num_words
    for token_id in set(token_ids):
        words[token_id // 32] |= 1 << (token_id % 32)
    return torch.tensor(words, dtype=torch.int32)


def pack_token_bitmask_int64_words(token_ids: list[int], num_words: int) -> torch.Tensor:
    """Leaves the words as unsigned values in int64: not the int32 row the mask holds."""
    words = [0] * num_words
    for token_id in set(token_ids):
        words[token_id // 32] |= 1 << (token_id % 32)
    return torch.tensor(words, dtype=torch.int64)


def pack_token_bitmask_words_reversed(token_ids: list[int], num_words: int) -> torch.Tensor:
    """Puts the words in the wrong order (the row read as one big number, most significant word first): token 0
    lands in the last word."""
    return _pack(token_ids, num_words).flip(0)


def pack_token_bitmask_sized_by_the_ids(token_ids: list[int], num_words: int) -> torch.Tensor:
    """Makes as many words as the largest id needs, ignoring `num_words`: a row too short whenever the last
    words allow nothing (and the vocabulary's last, partly used word is often one of them)."""
    return _pack(token_ids, max(token_ids, default=-1) // 32 + 1)


def pack_token_bitmask_float_words(token_ids: list[int], num_words: int) -> torch.Tensor:
    """Adds 2 ** j into float32 words (torch.zeros' default dtype): a float32 holds 24 significant bits, so a word
    with high and low bits set loses the low ones, and 2 ** 31 does not fit int32 at the end."""
    words = torch.zeros(num_words)
    for token_id in set(token_ids):
        words[token_id // 32] += 2.0 ** (token_id % 32)
    return words.to(torch.int32)


def pack_token_bitmask_scatter_overwrites(token_ids: list[int], num_words: int) -> torch.Tensor:
    """Writes each id's bit with `scatter_`, which replaces a word instead of adding to it: two allowed tokens in one
    word leave only one of their bits."""
    words = torch.zeros(num_words, dtype=torch.int64)
    ids = torch.tensor(sorted(set(token_ids)), dtype=torch.int64)
    words.scatter_(0, ids // 32, 1 << (ids % 32))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_token_bitmask_untyped_ids(token_ids: list[int], num_words: int) -> torch.Tensor:
    """Makes the ids a tensor without a dtype: an empty list (a grammar that allows nothing, as after EOS) becomes
    a float tensor, which `index_add_` refuses as an index."""
    words = torch.zeros(num_words, dtype=torch.int64)
    ids = torch.tensor(sorted(set(token_ids)))
    words.index_add_(0, ids // 32, 1 << (ids % 32))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_token_bitmask_drops_the_sign_bit(token_ids: list[int], num_words: int) -> torch.Tensor:
    """Keeps each word within int32 by masking it with 0x7FFFFFFF: bit 31 (tokens 31, 63, ...) is never set."""
    words = _pack(token_ids, num_words).to(torch.int64) & 0x7FFFFFFF
    return words.to(torch.int32)


# --- apply_token_bitmask -------------------------------------------------------------------------------------------


def _allowed(bitmask: torch.Tensor, vocab_size: int, *, msb_first: bool = False,
             past_the_mask: bool = False) -> torch.Tensor:
    bits = torch.arange(32, dtype=torch.int32)
    if msb_first:
        bits = 31 - bits
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=past_the_mask)


def apply_token_bitmask_zero_for_forbidden(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Sets a forbidden token's logit to 0 (multiplies by the mask): a forbidden token still has probability,
    and beats every allowed token whose logit is negative."""
    return logits * unpack_token_bitmask(bitmask, logits.shape[-1])


def apply_token_bitmask_big_negative(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Uses -1e9 for a forbidden token instead of -inf: fine for ordinary logits, but a forbidden token wins over
    allowed tokens whose logits are lower still, and temperature scaling moves it."""
    return logits.masked_fill(~unpack_token_bitmask(bitmask, logits.shape[-1]), -1e9)


def apply_token_bitmask_msb_first(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Reads bit 31 - j of word w as token 32w + j."""
    return logits.masked_fill(~_allowed(bitmask, logits.shape[-1], msb_first=True), float("-inf"))


def apply_token_bitmask_first_row_for_all(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Applies the first row's mask to every row of the batch."""
    allowed = unpack_token_bitmask(bitmask[:1], logits.shape[-1])
    return logits.masked_fill(~allowed, float("-inf"))


def apply_token_bitmask_inverted(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Reads a set bit as "forbidden": keeps exactly the tokens the grammar rules out."""
    return logits.masked_fill(unpack_token_bitmask(bitmask, logits.shape[-1]), float("-inf"))


def apply_token_bitmask_in_place(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Masks the caller's logits in place (masked_fill_) and returns them."""
    return logits.masked_fill_(~unpack_token_bitmask(bitmask, logits.shape[-1]), float("-inf"))


def apply_token_bitmask_allows_past_the_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Leaves the tokens the mask has no bit for (a padded vocabulary's last ids) allowed."""
    return logits.masked_fill(~_allowed(bitmask, logits.shape[-1], past_the_mask=True), float("-inf"))


def apply_token_bitmask_float32_terms(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Builds the additive 0 / -inf mask in float32 whatever the logits are: bf16 logits come back promoted to
    float32 (and on a GPU the mask is made on the host)."""
    allowed = unpack_token_bitmask(bitmask, logits.shape[-1])
    return logits + torch.where(allowed, 0.0, float("-inf")).to(logits.device)


def apply_token_bitmask_mask_left_on_the_host(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Unpacks the mask where it lies (the host) and applies it to the logits where they lie: on a GPU, masked_fill
    refuses a CPU mask for CUDA logits (`bitmask.to(logits.device)` forgotten)."""
    return logits.masked_fill(~unpack_token_bitmask(bitmask, logits.shape[-1]), float("-inf"))


def apply_token_bitmask_terms_on_the_host(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The byte lookup with its table cast to the logits' dtype but left on the host: the (N, V) additive terms are
    made on the CPU, and adding them to GPU logits fails."""
    terms = _BYTE_TO_LOGIT_TERMS.to(logits.dtype)
    additive = terms[bitmask.contiguous().view(torch.uint8).long()].flatten(1)
    if additive.shape[1] < logits.shape[-1]:
        additive = torch.nn.functional.pad(additive, (0, logits.shape[-1] - additive.shape[1]), value=float("-inf"))
    return logits + additive[:, : logits.shape[-1]]


def apply_token_bitmask_on_the_masks_device(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Brings the logits to the mask (`logits.to(bitmask.device)`) instead of the mask to the logits: on a GPU every
    step copies the (N, V) logits to the host, and the result comes back on the CPU."""
    logits = logits.to(bitmask.device)
    return logits.masked_fill(~unpack_token_bitmask(bitmask, logits.shape[-1]), float("-inf"))


def apply_token_bitmask_shifts_on_the_host(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Moves the mask to the logits' device but makes the shift amounts (`torch.arange(32)`) on the host: the shift
    mixes a GPU tensor with a CPU one."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.to(logits.device)[:, :, None] >> bits) & 1).bool().flatten(1)
    vocab_size = logits.shape[-1]
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return logits.masked_fill(~allowed[:, :vocab_size], float("-inf"))


# --- submit_grammar_bitmask ----------------------------------------------------------------------------------------


def _fill(grammars: list, bitmask: torch.Tensor) -> torch.Tensor:
    for row, grammar in enumerate(grammars):
        if grammar is not None:
            grammar.fill_bitmask(bitmask, row)
    return bitmask


def submit_grammar_bitmask_per_scheduled_sequence(
    scheduler_output: SchedulerOutput, executor: Executor, vocab_size: int
) -> "Future[torch.Tensor] | None":
    """One row per scheduled sequence: a prompt chunk that samples nothing gets a row, forked samples get none,
    so the mask no longer lines up with the logits rows."""
    grammars = [seq.grammar for seq in scheduler_output.scheduled_seqs]
    if all(grammar is None for grammar in grammars):
        return None
    return executor.submit(_fill, grammars, allocate_token_bitmask(len(grammars), vocab_size))


def submit_grammar_bitmask_row_owner_grammar(
    scheduler_output: SchedulerOutput, executor: Executor, vocab_size: int
) -> "Future[torch.Tensor] | None":
    """Fills each row from the grammar of the sequence that owns the logits row (`sampling_rows`' row indices): a
    forked sample gets its parent's mask, not its own grammar's."""
    rows, _ = sampling_rows(scheduler_output)
    grammars = [scheduler_output.scheduled_seqs[row].grammar for row in rows]
    if all(grammar is None for grammar in grammars):
        return None
    return executor.submit(_fill, grammars, allocate_token_bitmask(len(grammars), vocab_size))


def submit_grammar_bitmask_fills_inline(
    scheduler_output: SchedulerOutput, executor: Executor, vocab_size: int
) -> "Future[torch.Tensor] | None":
    """Fills every row on the caller's thread, then hands the executor a job that returns the mask: right masks, but
    the forward pass waits for the fill instead of running beside it."""
    grammars = [seq.grammar for seq in sampling_rows(scheduler_output)[1]]
    if all(grammar is None for grammar in grammars):
        return None
    bitmask = _fill(grammars, allocate_token_bitmask(len(grammars), vocab_size))
    return executor.submit(lambda: bitmask)


def submit_grammar_bitmask_done_before_the_fill(
    scheduler_output: SchedulerOutput, executor: Executor, vocab_size: int
) -> "Future[torch.Tensor] | None":
    """Starts the fill on the executor but returns a future that is already done, holding the tensor the fill is
    still writing: whoever waits on it does not wait for the fill, and samples through a half-filled mask."""
    grammars = [seq.grammar for seq in sampling_rows(scheduler_output)[1]]
    if all(grammar is None for grammar in grammars):
        return None
    bitmask = allocate_token_bitmask(len(grammars), vocab_size)
    executor.submit(_fill, grammars, bitmask)
    ready: Future = Future()
    ready.set_result(bitmask)
    return ready


def submit_grammar_bitmask_zeros_for_unconstrained(
    scheduler_output: SchedulerOutput, executor: Executor, vocab_size: int
) -> "Future[torch.Tensor] | None":
    """Starts every row at zero (nothing allowed) and fills only the rows with a grammar: an unconstrained sample
    in the same batch has every token forbidden."""
    grammars = [seq.grammar for seq in sampling_rows(scheduler_output)[1]]
    if all(grammar is None for grammar in grammars):
        return None
    bitmask = torch.zeros(len(grammars), (vocab_size + 31) // 32, dtype=torch.int32)
    return executor.submit(_fill, grammars, bitmask)


def submit_grammar_bitmask_words_rounded_down(
    scheduler_output: SchedulerOutput, executor: Executor, vocab_size: int
) -> "Future[torch.Tensor] | None":
    """Sizes the rows `vocab_size // 32` words: with a vocabulary that is not a multiple of 32 (GPT-2's 50,257) the
    last tokens have no bit, so they are forbidden in every row, constrained or not."""
    grammars = [seq.grammar for seq in sampling_rows(scheduler_output)[1]]
    if all(grammar is None for grammar in grammars):
        return None
    bitmask = torch.full((len(grammars), vocab_size // 32), -1, dtype=torch.int32)
    return executor.submit(_fill, grammars, bitmask)


def submit_grammar_bitmask_first_row_decides(
    scheduler_output: SchedulerOutput, executor: Executor, vocab_size: int
) -> "Future[torch.Tensor] | None":
    """Returns None when the first sampling row has no grammar: a constrained request scheduled after an
    unconstrained one samples without its mask."""
    grammars = [seq.grammar for seq in sampling_rows(scheduler_output)[1]]
    if not grammars or grammars[0] is None:
        return None
    return executor.submit(_fill, grammars, allocate_token_bitmask(len(grammars), vocab_size))


def submit_grammar_bitmask_submits_the_fills_result(
    scheduler_output: SchedulerOutput, executor: Executor, vocab_size: int
) -> "Future[torch.Tensor] | None":
    """Calls the fill and submits what it returned (`executor.submit(fill())`): the rows are filled on the caller's
    thread, and the executor is handed a tensor to call, so the future raises TypeError."""
    grammars = [seq.grammar for seq in sampling_rows(scheduler_output)[1]]
    if all(grammar is None for grammar in grammars):
        return None
    return executor.submit(_fill(grammars, allocate_token_bitmask(len(grammars), vocab_size)))


# --- ChoiceGrammar -------------------------------------------------------------------------------------------------


def _longest_match(text: str, tokens: TokenTexts) -> list[int]:
    """One tokenisation of `text`: the longest token that matches, again and again (what a tokenizer writes)."""
    ids = []
    while text:
        end = max(e for e in range(1, len(text) + 1) if text[:e] in tokens.ids_by_text)
        ids.append(tokens.ids_by_text[text[:end]][0])
        text = text[end:]
    return ids


class ChoiceGrammarCanonicalTokensOnly(ChoiceGrammar):
    """Tokenises each choice once and walks those token ids: "Par" + "is" is refused though it spells "Paris"."""

    def __init__(self, choices: list[str], tokens: TokenTexts) -> None:
        super().__init__(choices, tokens)
        self.paths = [_longest_match(c, tokens) for c in self.choices]
        self.ids: list[int] = []

    def allowed_token_ids(self) -> list[int]:
        if self.ended:
            return []
        n = len(self.ids)
        allowed = {path[n] for path in self.paths if path[:n] == self.ids and len(path) > n}
        if self.ids in self.paths and self.tokens.eos_token_id is not None:
            allowed.add(self.tokens.eos_token_id)
        return sorted(allowed)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for token_id in token_ids:
            if token_id not in self.allowed_token_ids():
                return False
            if token_id == self.tokens.eos_token_id:
                self.ended = True
            else:
                self.ids.append(token_id)
                self.text += self.tokens.texts[token_id]
        return True


class ChoiceGrammarEndsAnywhere(ChoiceGrammar):
    """Allows and accepts EOS at any point, before the text is a whole choice."""

    def allowed_token_ids(self) -> list[int]:
        allowed = super().allowed_token_ids()
        if not self.ended and self.tokens.eos_token_id not in allowed:
            allowed = sorted([*allowed, self.tokens.eos_token_id])
        return allowed

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for token_id in token_ids:
            if token_id == self.tokens.eos_token_id and not self.ended:
                self.ended = True
            elif not super().accept_tokens([token_id]):
                return False
        return True


class ChoiceGrammarStopsAtFirstChoice(ChoiceGrammar):
    """Ends as soon as the text equals a choice, even when a longer choice extends it ("Par" of "Paris")."""

    def is_terminated(self) -> bool:
        return self.ended or self.text in self.choices


class ChoiceGrammarAllowsEmptyTokens(ChoiceGrammar):
    """Tests every token's text against the choices, the empty texts of special tokens included ("" is a prefix
    of everything): padding and other special tokens are allowed and accepted anywhere."""

    def allowed_token_ids(self) -> list[int]:
        if self.ended:
            return []
        eos = self.tokens.eos_token_id
        allowed = [i for i, t in enumerate(self.tokens.texts)
                   if i != eos and any(c.startswith(self.text + t) for c in self.choices)]
        if self.text in self.choices and eos is not None:
            allowed.append(eos)
        return sorted(allowed)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for token_id in token_ids:
            if token_id == self.tokens.eos_token_id or self.ended:
                if not super().accept_tokens([token_id]):
                    return False
                continue
            text = self.text + self.tokens.texts[token_id]
            if not any(c.startswith(text) for c in self.choices):
                return False
            self.text = text
        return True


class ChoiceGrammarAcceptsAnything(ChoiceGrammar):
    """Advances by every token it is given, without checking it against the choices."""

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for token_id in token_ids:
            if token_id == self.tokens.eos_token_id:
                self.ended = True
            else:
                self.text += self.tokens.texts[token_id]
        return True


class ChoiceGrammarDecodesTokens(ChoiceGrammar):
    """Works on decoded text: each token's bytes decoded alone, those that decode to no whole character dropped
    (what `batch_decode` then a check for "\ufffd" does), so a choice in CJK text or emoji, or an "é" written as two
    tokens, cannot be produced."""

    def __init__(self, choices: list[str], tokens: TokenTexts) -> None:
        texts = [text.decode("utf-8", errors="replace") for text in tokens.texts]
        ids_by_text: dict[bytes, list[int]] = {}
        for token_id, text in enumerate(texts):
            if text and "\ufffd" not in text:
                ids_by_text.setdefault(text.encode(), []).append(token_id)
        super().__init__(choices, TokenTexts([t.encode() for t in texts], ids_by_text, tokens.eos_token_id))


class ChoiceGrammarFirstFittingChoiceOnly(ChoiceGrammar):
    """Follows only the first choice the text is a prefix of: with choices that share a first token ("Lon",
    "London", "Lyon" after "L"), the others are cut off."""

    def allowed_token_ids(self) -> list[int]:
        if self.ended:
            return []
        allowed = set()
        for choice in self.choices:
            if choice.startswith(self.text):
                rest = choice[len(self.text) :]
                for end in range(1, len(rest) + 1):
                    allowed.update(self.tokens.ids_by_text.get(rest[:end], []))
                break
        if self.text in self.choices and self.tokens.eos_token_id is not None:
            allowed.add(self.tokens.eos_token_id)
        return sorted(allowed)


class ChoiceGrammarRescansTheVocabulary(ChoiceGrammar):
    """Right answers, but tests every token of the vocabulary at every call: 49,152 string comparisons per
    constrained sample per step."""

    def allowed_token_ids(self) -> list[int]:
        if self.ended:
            return []
        allowed = [token_id for token_id, text in enumerate(self.tokens.texts)
                   if text and any(choice.startswith(self.text + text) for choice in self.choices)]
        if self.text in self.choices and self.tokens.eos_token_id is not None:
            allowed.append(self.tokens.eos_token_id)
        return sorted(allowed)


class ChoiceGrammarOrsIntoTheRow(ChoiceGrammar):
    """ORs the allowed tokens' bits into its row, as if the row started empty; the engine's rows start with every
    bit set (unconstrained), so nothing is ever forbidden."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] |= pack_token_bitmask(self.allowed_token_ids(), bitmask.shape[1])


def _allowed_towards_a_choice(grammar: ChoiceGrammar) -> set[int]:
    """The reference's allowed tokens without EOS: every token that keeps the text a prefix of some choice."""
    allowed = set()
    for choice_bytes in grammar.choices:
        if choice_bytes.startswith(grammar.text):
            rest = choice_bytes[len(grammar.text) :]
            for end in range(1, len(rest) + 1):
                allowed.update(grammar.tokens.ids_by_text.get(rest[:end], []))
    return allowed


class ChoiceGrammarEosEvenWithoutOne(ChoiceGrammar):
    """Adds the EOS id once the text is a whole choice without asking whether the vocabulary has one: with
    `eos_token_id=None` the allowed tokens hold None (and sorting None among ints raises TypeError)."""

    def allowed_token_ids(self) -> list[int]:
        if self.ended:
            return []
        allowed = _allowed_towards_a_choice(self)
        if self.text in self.choices:
            allowed.add(self.tokens.eos_token_id)
        return sorted(allowed)


class ChoiceGrammarEosZeroIsNoEos(ChoiceGrammar):
    """Asks `if self.tokens.eos_token_id:` for "is there an EOS token": an EOS whose id is 0 (as SmolLM2 base's
    <|endoftext|>) is never allowed, so no choice can end."""

    def allowed_token_ids(self) -> list[int]:
        if self.ended:
            return []
        allowed = _allowed_towards_a_choice(self)
        if self.text in self.choices and self.tokens.eos_token_id:
            allowed.add(self.tokens.eos_token_id)
        return sorted(allowed)


class ChoiceGrammarWithoutEosEndsAtAnyChoice(ChoiceGrammar):
    """Without an EOS token, ends as soon as the text is a whole choice: a longer choice it starts ("Paris" after
    "Par") can never be produced."""

    def is_terminated(self) -> bool:
        if self.tokens.eos_token_id is None:
            return self.ended or self.text in self.choices
        return super().is_terminated()

MUTANTS = {
    "pack_token_bitmask_msb_first": {"pack_token_bitmask": pack_token_bitmask_msb_first},
    "pack_token_bitmask_adds_repeats": {"pack_token_bitmask": pack_token_bitmask_adds_repeats},
    "pack_token_bitmask_31_per_word": {"pack_token_bitmask": pack_token_bitmask_31_per_word},
    "pack_token_bitmask_overflows_int32": {"pack_token_bitmask": pack_token_bitmask_overflows_int32},
    "pack_token_bitmask_int64_words": {"pack_token_bitmask": pack_token_bitmask_int64_words},
    "pack_token_bitmask_words_reversed": {"pack_token_bitmask": pack_token_bitmask_words_reversed},
    "pack_token_bitmask_sized_by_the_ids": {"pack_token_bitmask": pack_token_bitmask_sized_by_the_ids},
    "pack_token_bitmask_float_words": {"pack_token_bitmask": pack_token_bitmask_float_words},
    "pack_token_bitmask_scatter_overwrites": {"pack_token_bitmask": pack_token_bitmask_scatter_overwrites},
    "pack_token_bitmask_untyped_ids": {"pack_token_bitmask": pack_token_bitmask_untyped_ids},
    "pack_token_bitmask_drops_the_sign_bit": {"pack_token_bitmask": pack_token_bitmask_drops_the_sign_bit},
    "apply_token_bitmask_zero_for_forbidden": {"apply_token_bitmask": apply_token_bitmask_zero_for_forbidden},
    "apply_token_bitmask_big_negative": {"apply_token_bitmask": apply_token_bitmask_big_negative},
    "apply_token_bitmask_msb_first": {"apply_token_bitmask": apply_token_bitmask_msb_first},
    "apply_token_bitmask_first_row_for_all": {"apply_token_bitmask": apply_token_bitmask_first_row_for_all},
    "apply_token_bitmask_inverted": {"apply_token_bitmask": apply_token_bitmask_inverted},
    "apply_token_bitmask_in_place": {"apply_token_bitmask": apply_token_bitmask_in_place},
    "apply_token_bitmask_allows_past_the_mask": {"apply_token_bitmask": apply_token_bitmask_allows_past_the_mask},
    "apply_token_bitmask_float32_terms": {"apply_token_bitmask": apply_token_bitmask_float32_terms},
    "apply_token_bitmask_mask_left_on_the_host": {"apply_token_bitmask": apply_token_bitmask_mask_left_on_the_host},
    "apply_token_bitmask_terms_on_the_host": {"apply_token_bitmask": apply_token_bitmask_terms_on_the_host},
    "apply_token_bitmask_on_the_masks_device": {"apply_token_bitmask": apply_token_bitmask_on_the_masks_device},
    "apply_token_bitmask_shifts_on_the_host": {"apply_token_bitmask": apply_token_bitmask_shifts_on_the_host},
    "submit_grammar_bitmask_per_scheduled_sequence": {
        "submit_grammar_bitmask": submit_grammar_bitmask_per_scheduled_sequence},
    "submit_grammar_bitmask_row_owner_grammar": {"submit_grammar_bitmask": submit_grammar_bitmask_row_owner_grammar},
    "submit_grammar_bitmask_fills_inline": {"submit_grammar_bitmask": submit_grammar_bitmask_fills_inline},
    "submit_grammar_bitmask_done_before_the_fill": {
        "submit_grammar_bitmask": submit_grammar_bitmask_done_before_the_fill},
    "submit_grammar_bitmask_zeros_for_unconstrained": {
        "submit_grammar_bitmask": submit_grammar_bitmask_zeros_for_unconstrained},
    "submit_grammar_bitmask_words_rounded_down": {"submit_grammar_bitmask": submit_grammar_bitmask_words_rounded_down},
    "submit_grammar_bitmask_first_row_decides": {"submit_grammar_bitmask": submit_grammar_bitmask_first_row_decides},
    "submit_grammar_bitmask_submits_the_fills_result": {
        "submit_grammar_bitmask": submit_grammar_bitmask_submits_the_fills_result},
    "ChoiceGrammarCanonicalTokensOnly": {"ChoiceGrammar": ChoiceGrammarCanonicalTokensOnly},
    "ChoiceGrammarEndsAnywhere": {"ChoiceGrammar": ChoiceGrammarEndsAnywhere},
    "ChoiceGrammarStopsAtFirstChoice": {"ChoiceGrammar": ChoiceGrammarStopsAtFirstChoice},
    "ChoiceGrammarAllowsEmptyTokens": {"ChoiceGrammar": ChoiceGrammarAllowsEmptyTokens},
    "ChoiceGrammarAcceptsAnything": {"ChoiceGrammar": ChoiceGrammarAcceptsAnything},
    "ChoiceGrammarOrsIntoTheRow": {"ChoiceGrammar": ChoiceGrammarOrsIntoTheRow},
    "ChoiceGrammarDecodesTokens": {"ChoiceGrammar": ChoiceGrammarDecodesTokens},
    "ChoiceGrammarFirstFittingChoiceOnly": {"ChoiceGrammar": ChoiceGrammarFirstFittingChoiceOnly},
    "ChoiceGrammarRescansTheVocabulary": {"ChoiceGrammar": ChoiceGrammarRescansTheVocabulary},
    "ChoiceGrammarEosEvenWithoutOne": {"ChoiceGrammar": ChoiceGrammarEosEvenWithoutOne},
    "ChoiceGrammarEosZeroIsNoEos": {"ChoiceGrammar": ChoiceGrammarEosZeroIsNoEos},
    "ChoiceGrammarWithoutEosEndsAtAnyChoice": {"ChoiceGrammar": ChoiceGrammarWithoutEosEndsAtAnyChoice},
}

# One mutant per exercise that must make the capstone fail: each lets the sampler pick a token the grammar
# forbids, and the engine refuses it (RuntimeError: "... which its grammar's mask forbids"), or, for the hand-off,
# gives a mask whose rows are not the step's sampling rows (the capstone's n=3 choice request forks two samples).
CAPSTONE_MUTANTS = {
    "pack_token_bitmask": "pack_token_bitmask_msb_first",
    "apply_token_bitmask": "apply_token_bitmask_msb_first",
    "submit_grammar_bitmask": "submit_grammar_bitmask_per_scheduled_sequence",
    "ChoiceGrammar": "ChoiceGrammarOrsIntoTheRow",
}

# The statements each exercise's question is about, as `ast.unparse` writes them (a compound statement by its
# header). Hint 2 may show none of them, and nothing under chapters/ may state them (tests/test_hints.py): they
# live here, beside the wrong answers, because a learner reads the chapter's test file.
DECISIVE = {
    "pack_token_bitmask": [
        'words.index_add_(0, ids // 32, 1 << ids % 32)',
        'return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)',
    ],
    "apply_token_bitmask": [
        'mask_bytes = bitmask.to(logits.device).contiguous().view(torch.uint8).long()',
        'additive = terms[mask_bytes].flatten(1)',
    ],
    "submit_grammar_bitmask": [
        'grammars = [seq.grammar for seq in sampling_rows(scheduler_output)[1]]',
        'if all((grammar is None for grammar in grammars)):',
    ],
    "ChoiceGrammar": [
        'if self.text in self.choices and self.tokens.eos_token_id is not None:',
        'if text == self.text or not any((choice.startswith(text) for choice in self.choices)):',
        'allowed.update(self.tokens.ids_by_text.get(rest[:end], []))',
    ],
}
