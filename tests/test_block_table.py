"""The model runner's persistent block table: a decode step writes what changed, however long the contexts.

The structure is checked, never the time: `BlockTable.num_block_writes` counts every block id written, so a step
over long contexts must cost exactly what a step over short ones costs (one entry per new block), and the tensor
handed to the kernels must equal the one built from the sequences' lists.
"""

import torch

from grading.tiny_models import tiny_checkpoint
from solutions import LLM, SamplingParams
from solutions.attention.paged import AttentionMetadata
from solutions.core.sched.output import SchedulerOutput
from solutions.core.sequence import Sequence
from solutions.worker.block_table import BlockTable


def from_lists(seqs: list[Sequence]) -> torch.Tensor:
    """The block tables as `AttentionMetadata` builds them from the lists (the oracle)."""
    empty = torch.empty(0, dtype=torch.long)
    return AttentionMetadata(empty, empty, empty, [seq.block_table for seq in seqs]).block_table_tensor


def running(seq_id: int, block_table: list[int], num_computed_tokens: int) -> Sequence:
    seq = Sequence(seq_id, list(range(num_computed_tokens + 1)))
    seq.block_table, seq.num_computed_tokens = block_table, num_computed_tokens
    return seq


def step(*seqs: Sequence) -> SchedulerOutput:
    return SchedulerOutput(list(seqs), [1] * len(seqs))


def decode_writes(context_len: int, num_seqs: int = 8, num_steps: int = 12) -> tuple[list[int], list[int]]:
    """Per decode step of `num_seqs` sequences of `context_len` prompt tokens (block_size 4): block ids the runner
    wrote, and blocks the sequences gained. Each step's tensor is checked against the lists'."""
    llm = LLM(str(tiny_checkpoint("llama-gqa")), block_size=4, max_num_seqs=num_seqs, max_model_len=512, seed=0)
    engine = llm.llm_engine
    runner, scheduler = engine.engine_core.model_executor.model_runner, engine.engine_core.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 4, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(str(i), [(7 * i + j) % 250 + 3 for j in range(context_len)], params)
    while scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running):
        engine.step()
    writes, new_blocks = [], []
    for _ in range(num_steps):
        blocks_before = sum(len(seq.block_table) for seq in scheduler.running)
        writes_before = runner.block_table.num_block_writes
        engine.step()
        assert len(scheduler.running) == num_seqs, "every sequence still decodes"
        writes.append(runner.block_table.num_block_writes - writes_before)
        new_blocks.append(sum(len(seq.block_table) for seq in scheduler.running) - blocks_before)
        assert torch.equal(runner.block_table.update(step(*scheduler.running)), from_lists(scheduler.running))
    return writes, new_blocks


def test_a_decode_step_writes_only_its_new_blocks_whatever_the_context():
    short_writes, short_blocks = decode_writes(context_len=10)
    long_writes, long_blocks = decode_writes(context_len=400)  # 100 blocks a sequence
    assert short_writes == short_blocks and long_writes == long_blocks
    assert sum(long_blocks) == sum(short_blocks) == 8 * 3  # 12 tokens each: 3 new blocks of 4


def test_rows_are_kept_released_and_reused():
    table = BlockTable(block_size=4, max_num_seqs=2, max_model_len=8)
    a, b = running(0, [3, 1], 5), running(1, [0, 2, 5], 9)
    assert torch.equal(table.update(step(a, b)), from_lists([a, b]))
    assert table.num_block_writes == 5  # both tables once
    a.block_table.append(6)
    a.num_computed_tokens = 8
    assert torch.equal(table.update(step(b, a)), from_lists([b, a]))  # batch order, not row order
    assert table.num_block_writes == 6  # the one appended block
    c = running(2, [4], 2)  # b leaves the batch: its row goes to c, its longer table's entries zeroed
    assert torch.equal(table.update(step(a, c)), from_lists([a, c]))
    assert table.rows == {0: 0, 2: 1} and table.num_block_writes == 7


def test_a_copy_on_write_replacement_is_written():
    table = BlockTable(block_size=4)
    a = running(0, [3, 1], 6)
    table.update(step(a))
    a.block_table[1] = 7  # the shared partial block this step writes into, copied on write
    assert table.update(step(a)).tolist() == [[3, 7]]
    assert table.num_block_writes == 3


def test_a_reused_seq_id_with_a_new_table_is_written_anew():
    """A hand-made step may reuse a seq_id with another sequence or another list (chapter demos do): the row is
    rewritten, not trusted."""
    table = BlockTable(block_size=4)
    table.update(step(running(0, [3, 1], 5)))
    other = running(0, [8, 9], 5)
    assert table.update(step(other)).tolist() == [[8, 9]]
    other.block_table = [2, 4]
    assert table.update(step(other)).tolist() == [[2, 4]]


def test_a_sequence_admitted_again_in_the_same_step_is_written_anew():
    """Preempted and re-admitted within one schedule, a sequence never leaves the batch, but its table is new: the
    same list object, cleared and refilled with other cached blocks before its first new token. The step lists
    it as resumed (or swapped in): its row is rewritten whole, not compared from the new token's block on."""
    table = BlockTable(block_size=4)
    a = running(0, [3, 1, 5], 10)
    table.update(step(a))
    for field, new_table in [("resumed_seq_ids", [6, 2, 7]), ("swapped_in_seq_ids", [9, 8, 4]), ("new_seq_ids", [1])]:
        a.block_table[:] = new_table  # e.g. recomputed: a prefix-cache hit on blocks 6 and 2, a fresh block 7
        out = step(a)
        setattr(out, field, [0])
        assert table.update(out).tolist() == [new_table], field


def test_the_table_grows_past_its_initial_rows_and_columns():
    table = BlockTable(block_size=4, max_num_seqs=1, max_model_len=4)
    seqs = [running(i, list(range(i, i + 3 * i + 1)), 4 * (3 * i + 1) - 1) for i in range(5)]
    assert torch.equal(table.update(step(*seqs)), from_lists(seqs))
