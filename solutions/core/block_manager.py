"""Paged KV-cache allocation: block tables grown one block at a time.

A sequence's keys and values live in fixed-size blocks of `block_size` token slots, scattered anywhere in the
cache. Its block table maps logical block `i` (token positions `[i * block_size, (i + 1) * block_size)`) to a
physical block id, so a sequence only ever holds `cdiv(num_tokens, block_size)` blocks: at most
`block_size - 1` slots are unused, all in its last block. Nothing is reserved for tokens not yet generated.

The life of a sequence:
    prefill   `can_allocate` / `allocate`          blocks for every token it has (prompt, or prompt + outputs
                                                   after a preemption by recompute)
    decode    `can_append_slot` / `append_slot`    after each `append_token`: one new block when the newest
                                                   token starts a block, otherwise nothing
    finish    `free`                               every block back to the pool

Where this lives in vLLM: `vllm/v1/core/kv_cache_manager.py` (`KVCacheManager.allocate_slots`, which does both
of our allocation verbs and returns None where we answer False) and `vllm/v1/core/block_pool.py`.
"""

from solutions.core.block_pool import BlockPool
from solutions.core.sequence import Sequence
from solutions.utils.math_utils import cdiv


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The flat cache slot of each token position in `[start, end)`.

    Slot = physical block * block_size + offset in the block; the KV store writes token `p`'s key and value
    at `k_cache.view(-1, ...)[slot]`. Example: block_table [7, 2], block_size 4, positions 3..5 → [31, 8, 9].
    """
    if not 0 <= start <= end <= len(block_table) * block_size:
        raise ValueError(f"positions [{start}, {end}) are outside the {len(block_table)} blocks of the block table "
                         f"({len(block_table) * block_size} slots at block_size {block_size})")
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class BlockManager:
    """Gives sequences blocks from one `BlockPool` and keeps their block tables.

    Invariants (checked by tests over long random runs):
    - a sequence that holds blocks holds exactly `cdiv(seq.num_tokens, block_size)` of them after
      `allocate`/`append_slot`;
    - without sharing, every used block sits in exactly one block table, with `ref_cnt == 1`;
    - `num_free_blocks + num_used_blocks == num_blocks`.
    Asking for memory that is not free raises `ValueError` saying what was asked for and what is free; the
    scheduler asks `can_allocate`/`can_append_slot` first, so in a running engine that never happens.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        _check_positive_int("num_blocks", num_blocks)
        _check_positive_int("block_size", block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.block_pool.num_free_blocks

    # prefill --------------------------------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        """Are there enough free blocks for all of `seq`'s tokens?"""
        return cdiv(seq.num_tokens, self.block_size) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Fill `seq.block_table` with new blocks covering all `seq.num_tokens` tokens."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds {len(seq.block_table)} blocks; free it first")
        num_new_blocks = cdiv(seq.num_tokens, self.block_size)
        if num_new_blocks > self.num_free_blocks:
            raise ValueError(
                f"cannot allocate sequence {seq.seq_id}: {seq.num_tokens} tokens need {num_new_blocks} blocks "
                f"of {self.block_size}, only {self.num_free_blocks} of {self.num_blocks} blocks are free"
            )
        seq.block_table.extend(block.block_id for block in self.block_pool.get_new_blocks(num_new_blocks))

    # decode ---------------------------------------------------------------------------------------------------

    def _num_missing_blocks(self, seq: Sequence) -> int:
        """0 or 1: whether the newest token needs a block that `seq` does not hold yet."""
        if not seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} holds no blocks; allocate it before decoding")
        num_missing = cdiv(seq.num_tokens, self.block_size) - len(seq.block_table)
        if num_missing not in (0, 1):
            raise RuntimeError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens but {len(seq.block_table)} blocks of "
                f"{self.block_size}: append_slot covers one new token per call"
            )
        return num_missing

    def can_append_slot(self, seq: Sequence) -> bool:
        """After `append_token`: is there room for the newest token (a new block only at a block boundary)?"""
        return self._num_missing_blocks(seq) <= self.num_free_blocks

    def append_slot(self, seq: Sequence) -> None:
        """Make `seq.block_table` cover `seq.num_tokens` tokens, adding at most one block."""
        if self._num_missing_blocks(seq) == 0:
            return
        if self.num_free_blocks == 0:
            raise ValueError(
                f"cannot append a slot to sequence {seq.seq_id}: token {seq.num_tokens} starts a new block "
                f"and 0 of {self.num_blocks} blocks are free"
            )
        seq.block_table.extend(block.block_id for block in self.block_pool.get_new_blocks(1))

    # finish ---------------------------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Return all of `seq`'s blocks to the pool and clear its block table.

        The blocks are freed last block first, so they queue up for reuse tail first: once prefix caching keeps
        freed blocks' contents, the head of a sequence (the part other prompts share) is evicted last.
        """
        blocks = self.block_pool.blocks
        self.block_pool.free_blocks(blocks[block_id] for block_id in reversed(seq.block_table))
        seq.block_table.clear()
