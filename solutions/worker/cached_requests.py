"""What a worker process is sent each step: its requests whole once, then only what changed.

A worker in another process (a tensor-parallel rank, a data-parallel replica) cannot share the step's `Sequence`s,
and pickling them whole every step costs O(total context), where a decode step changes one token and at most one
block per sequence. So the engine's end of each pipe keeps what that worker has been sent (`StepEncoder`), and the
worker keeps a copy of each sequence (`CachedRequests`): built from `NewRequestData` when first scheduled (or after
a preemption, swap or re-placement), then updated by `CachedRequestData` — the tokens appended since, and the block
table from the block holding the step's first new token on (earlier blocks do not change while it runs, the
invariant `BlockTable` relies on too). Finished sequences are named once in `finished_seq_ids` and forgotten.

A sampling worker (a data-parallel replica) is sent each drawing sequence's generator state once and draws from it
from then on, so a seeded request samples what it samples in one process. (A sequence requeued from a dead
replica restarts its stream from the state first sent.) The worker rebuilds the step's `SchedulerOutput` over its
copies, the same objects from step to step, so its runner runs the same code as in one process.

Where this lives in vLLM: `vllm/v1/core/sched/output.py` (`NewRequestData`, `CachedRequestData`,
`SchedulerOutput.finished_req_ids`: "we cache the request's data in each worker process, so that we don't need
to re-send it every scheduling step") and `vllm/v1/worker/gpu_model_runner.py` (`_update_states`).
"""

import dataclasses
import multiprocessing.reduction
from dataclasses import dataclass, field

import torch

from solutions.core.sched.output import SchedulerOutput
from solutions.core.sched.scheduler import advance_computed_tokens
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.sampling_params import SamplingParams


def state_bytes(generator: torch.Generator) -> bytes:
    """A generator's state as plain bytes: pickled as a tensor, `multiprocessing` would put each of them in a
    shared-memory segment of its own, which costs more than the 5 KB it holds."""
    return generator.get_state().numpy().tobytes()


def load_state(generator: torch.Generator, state: bytes) -> torch.Generator:
    """`generator`, set in place to resume from `state_bytes`'s bytes."""
    return generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


@dataclass(slots=True)
class NewRequestData:
    """A sequence the worker does not hold: all of it that the runner reads."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    block_table: list[int]
    sampling_params: SamplingParams | None


@dataclass(slots=True)
class CachedRequestData:
    """The held sequences' changes since the worker last saw them, one column per field as vLLM's: for sequence
    `seq_ids[i]`, its new tokens, and its block table from block `first_blocks[i]` on (`block_ids[i]`; the table is
    cut there and these appended). Columns of ints pickle in C; one object per sequence would cost a Python call
    each way."""

    seq_ids: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    first_blocks: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)

@dataclass(slots=True)
class StepDelta:
    """One step for one worker: the `SchedulerOutput` without its sequences (`scheduler_output`, whose
    `scheduled_seqs` and `forked_seqs` are empty), the scheduled sequences in batch order as new or cached data,
    the step's forks as (parent id, child ids), what to forget, and the generator states of the drawing sequences
    this worker is sent for the first time (only for a worker that samples)."""

    scheduler_output: SchedulerOutput
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    batch_order: list[int] = field(default_factory=list)  # seq_ids, the step's order
    forks: list[tuple[int, list[int]]] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    generator_states: dict[int, bytes] = field(default_factory=dict)


class StepEncoder:
    """The engine's record of what one worker holds: seq_id -> (the engine's sequence, tokens sent)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.sent: dict[int, tuple[Sequence, int]] = {}

    def encode(self, out: SchedulerOutput, generators: bool = False) -> StepDelta:
        """The step as `out` describes it, in terms of what the worker already holds; with `generators`, the
        generator states of the drawing (not greedy) sequences it holds for the first time travel too."""
        finished = [seq_id for seq_id, (seq, _) in self.sent.items() if seq.is_finished]
        for seq_id in finished:
            del self.sent[seq_id]
        delta = StepDelta(dataclasses.replace(out, scheduled_seqs=[], forked_seqs={}), finished_seq_ids=finished,
                          batch_order=[seq.seq_id for seq in out.scheduled_seqs])
        rewrite = {*out.new_seq_ids, *out.resumed_seq_ids, *out.swapped_in_seq_ids}  # their tables are new
        cached, first_seen = delta.cached_reqs, []
        for seq, start in zip(out.scheduled_seqs, out.num_computed_tokens, strict=True):
            sent = self.sent.get(seq.seq_id)
            if sent is None:
                first_seen.append(seq)
            if sent is None or seq.seq_id in rewrite:
                delta.new_reqs.append(NewRequestData(seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens,
                                                     list(seq.block_table), seq.sampling_params))
            else:
                first = start // self.block_size
                cached.seq_ids.append(seq.seq_id)
                cached.new_token_ids.append(seq.token_ids[sent[1] :])
                cached.first_blocks.append(first)
                cached.block_ids.append(seq.block_table[first:])
            self.sent[seq.seq_id] = seq, seq.num_tokens
        for parent_id, children in out.forked_seqs.items():
            delta.forks.append((parent_id, [child.seq_id for child in children]))
            self.sent.update((child.seq_id, (child, child.num_tokens)) for child in children)
            first_seen += children
        if generators:
            delta.generator_states = {
                seq.seq_id: state_bytes(seq.generator) for seq in first_seen
                if seq.generator is not None and not seq.sampling_params.greedy
            }
        return delta

    def message(self, out: SchedulerOutput, generators: bool = False) -> bytes:
        """`encode`'s delta as the bytes that cross the pipe (pickled as `multiprocessing` pickles)."""
        return bytes(multiprocessing.reduction.ForkingPickler.dumps(self.encode(out, generators)))


class CachedRequests:
    """The worker's copies of the sequences it runs, seq_id -> `Sequence`, kept from step to step."""

    def __init__(self) -> None:
        self.seqs: dict[int, Sequence] = {}

    def apply(self, delta: StepDelta) -> SchedulerOutput:
        """Bring the copies up to date and return the step's `SchedulerOutput` over them."""
        for seq_id in delta.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in delta.new_reqs:
            seq = self.seqs.get(new.seq_id)  # held already after a preemption or a swap: keep its generator
            if seq is None:
                seq = self.seqs[new.seq_id] = Sequence(new.seq_id, new.token_ids[: new.num_prompt_tokens])
            seq.token_ids, seq.block_table, seq.sampling_params = new.token_ids, new.block_table, new.sampling_params
            seq.status = SequenceStatus.RUNNING
        cached = delta.cached_reqs
        for seq_id, new_token_ids, first, block_ids in zip(
            cached.seq_ids, cached.new_token_ids, cached.first_blocks, cached.block_ids, strict=True
        ):
            seq = self.seqs[seq_id]
            seq.token_ids += new_token_ids
            del seq.block_table[first:]  # in place: the runner's block table knows this list
            seq.block_table += block_ids
        out = delta.scheduler_output
        out.scheduled_seqs = [self.seqs[seq_id] for seq_id in delta.batch_order]
        advance_computed_tokens(out)
        for parent_id, child_ids in delta.forks:
            parent = self.seqs[parent_id]
            for child_id in child_ids:
                self.seqs[child_id] = parent.fork(child_id)
                self.seqs[child_id].block_table = list(parent.block_table)  # shared, as the KV cache manager's fork
            out.forked_seqs[parent_id] = [self.seqs[child_id] for child_id in child_ids]
        for seq_id, state in delta.generator_states.items():
            self.seqs[seq_id].generator = load_state(torch.Generator(), state)
        return out
