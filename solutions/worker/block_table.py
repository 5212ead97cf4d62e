"""The persistent block table: the runner's copy of the running sequences' block tables, kept from step to step.

Attention kernels take the step's block tables as one (B, max_blocks) int32 tensor. Rebuilt every step, that costs
a Python write per block of every sequence, though a decode step changes at most one block per sequence. So, as
vLLM's persistent batch does, a sequence keeps its row while it stays in the batch, a step writes only what
changed (a block appended or copied on write), and one gather lays the rows out in batch order.

Invariant: while a sequence keeps its row, the entries before the block holding its first new token
(`num_computed_tokens // block_size`) never change; it only loses them by leaving the batch, and a row is
released in the first step without its sequence. A sequence preempted and admitted again within one schedule
never leaves the batch, yet its table is new: rows the step lists as admitted (`new_seq_ids`, `resumed_seq_ids`,
`swapped_in_seq_ids`) are written whole, as is a row whose sequence or block-table list is not the one it was
written from.

Where this lives in vLLM: `vllm/v1/worker/block_table.py` (`BlockTable`: `add_row`, `append_row`), and the row of
each request in `vllm/v1/worker/gpu_input_batch.py` (`InputBatch.req_id_to_index`; `GPUModelRunner._update_states`
removes the requests a step does not schedule).
"""

import numpy as np
import torch

from solutions.core.sched.output import SchedulerOutput
from solutions.core.sequence import Sequence
from solutions.utils.math_utils import cdiv


class BlockTable:
    """Rows of block ids (a numpy array, written element by element at Python's cost of one, shared with a torch
    tensor), one per sequence of the last step's batch; `num_block_writes` counts the entries written, so a test
    can check that a step costs its changes, not its contexts. Grows (doubling) when a batch or a table needs it.

    Invariant: row r holds `tables[r][:num_blocks[r]]` and zeros after it (the padding kernels expect: block 0,
    never read past a sequence's length).
    """

    def __init__(self, block_size: int, max_num_seqs: int = 8, max_model_len: int = 256) -> None:
        self.block_size = block_size
        self.np = np.zeros((max_num_seqs, cdiv(max_model_len, block_size)), dtype=np.int32)  # (rows, max_blocks)
        self.cpu = torch.from_numpy(self.np)  # the same memory
        self.rows: dict[int, int] = {}  # seq_id -> its row
        self.seqs: list[Sequence | None] = [None] * max_num_seqs  # each row's sequence
        self.tables: list[list[int] | None] = [None] * max_num_seqs  # the block-table list each row was written from
        self.num_blocks = [0] * max_num_seqs
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))  # popped from the end: row 0 first
        self.num_block_writes = 0  # entries written since construction

    def update(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        """Release the rows of sequences not in this step, bring the step's rows up to date, and return the step's
        block tables (B, max_blocks) int32 in batch order, zero-padded: what `AttentionMetadata.block_table_tensor`
        builds from the lists, at the cost of what changed plus one gather."""
        seqs = scheduler_output.scheduled_seqs
        scheduled = {seq.seq_id for seq in seqs}
        for seq_id in [seq_id for seq_id in self.rows if seq_id not in scheduled]:
            self._release(seq_id)
        out = scheduler_output  # admitted this step, perhaps again (a preemption and re-admission in one schedule):
        rewrite = {*out.new_seq_ids, *out.resumed_seq_ids, *out.swapped_in_seq_ids}  # their tables are new
        rows = []
        for seq, start in zip(seqs, out.num_computed_tokens, strict=True):
            row = self.rows.get(seq.seq_id)
            kept = row is not None and self.seqs[row] is seq and self.tables[row] is seq.block_table
            if kept and seq.seq_id not in rewrite:
                self._append(row, seq.block_table, start // self.block_size)
            else:
                if row is not None:
                    self._release(seq.seq_id)
                row = self._add_row(seq)
            rows.append(row)
        width = max((len(seq.block_table) for seq in seqs), default=0)
        return self.cpu[torch.tensor(rows, dtype=torch.long), :width]  # (B, width)

    def _add_row(self, seq: Sequence) -> int:
        """A free row for `seq`, its whole table written (and the previous occupant's extra entries zeroed)."""
        table = seq.block_table
        self._reserve(len(self.rows) + 1, len(table))
        row = self.free_rows.pop()
        self.rows[seq.seq_id], self.seqs[row], self.tables[row] = row, seq, table
        self.np[row, : len(table)] = table
        self.np[row, len(table) : self.num_blocks[row]] = 0
        self.num_blocks[row] = len(table)
        self.num_block_writes += len(table)
        return row

    def _append(self, row: int, table: list[int], first: int) -> None:
        """Bring a kept row up to `table`: from block `first` on (the one this step's first new token goes in), the
        entries that differ (a copy-on-write's new block), then the blocks appended since the last step."""
        num_old, num_new = self.num_blocks[row], len(table)
        self._reserve(len(self.rows), num_new)
        entries = self.np[row]
        for i in range(first, min(num_old, num_new)):
            if entries[i] != table[i]:
                entries[i] = table[i]
                self.num_block_writes += 1
        entries[num_old:num_new] = table[num_old:num_new]
        self.num_block_writes += max(num_new - num_old, 0)
        entries[num_new:num_old] = 0  # a table that shrank (blocks handed back)
        self.num_blocks[row] = num_new

    def _release(self, seq_id: int) -> None:
        row = self.rows.pop(seq_id)
        self.seqs[row] = self.tables[row] = None
        self.free_rows.append(row)

    def _reserve(self, num_rows: int, num_blocks: int) -> None:
        """Room for `num_rows` rows of `num_blocks` blocks: the array doubled in each dimension that is short."""
        old_rows, old_cols = self.np.shape
        if num_rows <= old_rows and num_blocks <= old_cols:
            return
        new_rows = max(num_rows, 2 * old_rows) if num_rows > old_rows else old_rows
        new_cols = max(num_blocks, 2 * old_cols) if num_blocks > old_cols else old_cols
        grown = np.zeros((new_rows, new_cols), dtype=np.int32)
        grown[:old_rows, :old_cols] = self.np
        self.np, self.cpu = grown, torch.from_numpy(grown)
        self.seqs += [None] * (new_rows - old_rows)
        self.tables += [None] * (new_rows - old_rows)
        self.num_blocks += [0] * (new_rows - old_rows)
        self.free_rows = list(range(new_rows - 1, old_rows - 1, -1)) + self.free_rows
