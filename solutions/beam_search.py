"""Beam search over the paged KV cache: beams are sequences that share blocks.

Each step, of all (beam, token) candidates the `beam_width` with the highest cumulative logprob survive. A
survivor *forks* its parent (the parent's block table, every block's `ref_cnt` + 1) and appends its token; then
every parent is freed. So a parent with two survivors keeps its blocks shared, one with none gives them back, and
the shared partial last block is copied on write. Beams share most of their history: that is why paging saves so
much memory here (the paper's §4.5 and §6.3).

The ranking is Hugging Face's `generate(num_beams=k)`: the top 2k of the flattened (beams × vocab) scores, so up to
k may end in EOS and k live ones remain; an EOS candidate among the first k is set aside as finished; a prompt's
search ends once `beam_width` beams have finished (`early_stopping=True`) or after `max_tokens`. Only then is
vLLM's length penalty applied, `cum_logprob / len ** length_penalty` (len counts the prompt, not a final EOS).
vLLM 0.32's offline `beam_search` applies it every step instead, which can drop a beam HF keeps.

Where this lives in vLLM: `vllm/beam_search.py` (`BeamSearchSequence`, `BeamSearchOutput`,
`get_beam_search_score`), `vllm/sampling_params.py` (`BeamSearchParams`) and `LLM.beam_search` in
`vllm/entrypoints/llm.py`, which runs outside the engine core as this one does.
"""

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sched.output import SchedulerOutput
from solutions.core.sched.scheduler import advance_computed_tokens
from solutions.core.sequence import Sequence
from solutions.kv_offload.swap import num_group_blocks
from solutions.outputs import FinishReason
from solutions.utils.math_utils import cdiv


@dataclass(slots=True)
class BeamSearchParams:
    """`beam_width` beams per prompt, at most `max_tokens` new tokens each (greedy: width 1)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0  # > 1 favours longer finished beams, < 1 shorter ones

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, int | float):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: `tokens` (prompt + generated), each generated token's `logprobs`, their sum `cum_logprob`."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass(slots=True)
class Beam:
    """A beam during the search: its engine sequence (holding blocks while live) and its scores."""

    seq: Sequence
    cum_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)


def get_beam_search_score(
    tokens: list[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float
) -> float:
    """vLLM's ranking score: the cumulative logprob over the length (prompt included, a final EOS not)."""
    seq_len = len(tokens) - (1 if eos_token_id is not None and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (seq_len**length_penalty)


def beam_search_step(
    manager: KVCacheManager, beams: list[Beam], logprobs: torch.Tensor, beam_width: int, eos_token_id: int | None,
    seq_ids: Iterator[int],
) -> tuple[list[Beam], list[Beam]]:
    """One step for one prompt: choose the surviving candidates, fork them from their parents, free the parents.

    `logprobs` (B, V) are the next-token logprobs of `beams` (B live beams). Returns (live, finished): at most
    `beam_width` live beams, best first, each a forked sequence holding its parent's blocks plus its new
    token; and the beams that ended in `eos_token_id` (None: EOS ignored) among the first `beam_width`
    candidates — those hold no blocks. Afterwards the parents hold no blocks.
    """
    num_beams, vocab_size = logprobs.shape
    if num_beams != len(beams):
        raise ValueError(f"logprobs has {num_beams} rows for {len(beams)} beams")
    cum = torch.tensor([beam.cum_logprob for beam in beams], dtype=torch.float32, device=logprobs.device)  # (B,)
    scores = (cum[:, None] + logprobs.float()).flatten()  # (B * V,) in float32, as HF adds them
    top_scores, top_ids = scores.topk(min(2 * beam_width, scores.numel()))  # best first
    live: list[Beam] = []
    finished: list[Beam] = []
    for rank, (score, flat_id) in enumerate(zip(top_scores.tolist(), top_ids.tolist(), strict=True)):
        parent, token_id = divmod(flat_id, vocab_size)
        is_eos = token_id == eos_token_id
        if is_eos and rank >= beam_width:
            continue  # an EOS below the top beam_width candidates is not a finished beam (HF's rule)
        child = beams[parent].seq.fork(next(seq_ids))
        if not is_eos:
            manager.fork(beams[parent].seq, child)  # shares every block; a finished beam needs none
        child.append_token(token_id)
        token_logprob = float(logprobs[parent, token_id])
        (finished if is_eos else live).append(Beam(child, score, beams[parent].logprobs + [token_logprob]))
        if len(live) == beam_width:
            break
    for beam in beams:
        manager.free(beam.seq)
    return live, finished


def _num_generated(beams: list[Beam]) -> int:
    """Tokens a prompt's live beams have generated (they all step together)."""
    seq = beams[0].seq
    return seq.num_tokens - seq.num_prompt_tokens


def _swap_beam_groups(
    manager: KVCacheManager, live: list[list[Beam]], active: list[int], swapped: list[int],
    scheduler_output: SchedulerOutput,
) -> None:
    """Chapter 11 for beam search: bring swapped-out prompts' beams back while they fit beside the rest, oldest first;
    else, while the step's beams would not fit, swap out the last prompt's beams (never the only one on the device).

    A beam needs at most one new block per step (a fresh one, or a copy of a shared partial block); a prompt's
    first step needs its whole prompt's blocks. The copies go into `scheduler_output`.
    """
    def group(p: int) -> list[Sequence]:
        return [beam.seq for beam in live[p]]

    def blocks_needed(p: int) -> int:
        beams = live[p]
        if not beams[0].seq.block_table and beams[0].seq.num_computed_tokens == 0:
            return cdiv(beams[0].seq.num_tokens, manager.block_size)
        return len(beams)

    def room() -> int:  # free device blocks left once the beams on the device have stepped
        return manager.num_free_blocks - sum(blocks_needed(p) for p in on_device)

    on_device = [p for p in active if p not in swapped]
    while swapped and (not on_device or room() >= num_group_blocks(group(swapped[0])) + len(live[swapped[0]])):
        p = swapped.pop(0)  # with nothing on the device it comes back anyway: if it cannot fit, the allocation says so
        scheduler_output.blocks_to_swap_in += manager.swap_in(group(p))
        on_device.append(p)
    if scheduler_output.blocks_to_swap_in:
        return  # as the scheduler: no swap-out in a step that swaps in
    host = manager.swap_pool
    while room() < 0 and len(on_device) > 1 and num_group_blocks(group(on_device[-1])) <= host.num_free_blocks:
        p = on_device.pop()
        scheduler_output.blocks_to_swap_out += manager.swap_out(group(p))
        swapped.append(p)


def run_beam_search(
    manager: KVCacheManager, model_runner, prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None,
    max_model_len: int, seq_ids: Iterator[int] | None = None, on_step=None,
) -> list[list[BeamSearchSequence]]:
    """Beam search for every prompt at once, one forward pass per step for all live beams of all prompts.

    Drives `manager` and `model_runner` directly, as its own small scheduler: each step allocates slots for every
    live beam (its prompt with prefix hits at the first step, then its newest token), gathers the copy-on-write
    copies, advances the computed tokens as the scheduler does, and runs one forward pass. `on_step(manager, beams)`
    is called after each step's allocation (for memory measurements). Returns, per prompt, its beams best first (text
    not filled in). With a swap pool (chapter 11), a prompt's beams are a sequence group, swapped out whole when the
    step's beams would not fit (`_swap_beam_groups`); without one, or if one prompt's beams cannot fit: ValueError.
    """
    seq_ids = itertools.count() if seq_ids is None else seq_ids
    eos = None if params.ignore_eos else eos_token_id
    live: list[list[Beam]] = [[Beam(Sequence(next(seq_ids), list(prompt)))] for prompt in prompts]
    done: list[list[Beam]] = [[] for _ in prompts]
    swapped: list[int] = []  # prompts whose beams are in the swap pool, in the order they went out
    try:
        while True:
            active = [
                p for p in range(len(prompts))
                if live[p] and len(done[p]) < params.beam_width and _num_generated(live[p]) < params.max_tokens
            ]
            if not active:
                break
            scheduler_output = SchedulerOutput()
            if manager.offloading is not None:
                manager.offloading.complete_transfers()  # the previous step has run
            if manager.swap_pool is not None:
                _swap_beam_groups(manager, live, active, swapped, scheduler_output)
                active = [p for p in active if p not in swapped]
            batch = [beam for p in active for beam in live[p]]
            for beam in batch:
                seq = beam.seq
                hits, num_cached = manager.get_computed_blocks(seq) if not seq.block_table else ([], 0)
                num_new = seq.num_tokens - seq.num_computed_tokens - num_cached
                copies = manager.allocate_slots(seq, num_new, hits)
                if copies is None:
                    raise ValueError(f"the KV cache ({manager.num_blocks} blocks of {manager.block_size}) cannot hold "
                                     f"{len(batch)} beams; raise num_kv_blocks or lower beam_width")
                scheduler_output.scheduled_seqs.append(seq)
                scheduler_output.num_scheduled_tokens.append(num_new)
                scheduler_output.num_computed_tokens.append(seq.num_computed_tokens + num_cached)  # after the hits
                scheduler_output.blocks_to_copy.extend(copies)
            if manager.offloading is not None:  # blocks this step's allocations evicted go to the host tier
                scheduler_output.blocks_to_store, _ = manager.offloading.take_transfers()
            advance_computed_tokens(scheduler_output)
            if on_step is not None:
                on_step(manager, batch)
            logits = model_runner.execute_model(scheduler_output)  # (B, V)
            logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
            row = 0
            for p in active:
                rows = logprobs[row : row + len(live[p])]
                row += len(live[p])
                live[p], finished = beam_search_step(manager, live[p], rows, params.beam_width, eos, seq_ids)
                done[p].extend(finished)
                if any(beam.seq.num_tokens >= max_model_len for beam in live[p]):
                    for beam in live[p]:
                        manager.free(beam.seq)
                    done[p].extend(live[p])
                    live[p] = []
                elif live[p] and (len(done[p]) >= params.beam_width or _num_generated(live[p]) >= params.max_tokens):
                    for beam in live[p]:  # this prompt is done while others still step: its blocks are theirs now
                        manager.free(beam.seq)
    finally:
        for p, beams in enumerate(live):
            free = manager.free_swapped if p in swapped else manager.free
            for beam in beams:
                free(beam.seq)
    results = []
    for p in range(len(prompts)):
        beams = done[p] if len(done[p]) >= params.beam_width else done[p] + live[p]
        penalty = params.length_penalty
        beams.sort(key=lambda b: get_beam_search_score(b.seq.token_ids, b.cum_logprob, eos, penalty), reverse=True)
        results.append([
            BeamSearchSequence(beam.seq.token_ids, beam.logprobs, beam.cum_logprob, finish_reason=(
                FinishReason.STOP if eos is not None and beam.seq.last_token_id == eos else FinishReason.LENGTH))
            for beam in beams[: params.beam_width]
        ])
    return results
