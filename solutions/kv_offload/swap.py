"""Swapping (the paper's §4.5): a preempted sequence group's blocks go to a host pool and come back whole.

A group is every running sample of one request (the n samples of `n > 1`): they share blocks, so they leave
together and each shared block is copied once — the host block gets one reference per sequence that held the
device block, exactly as on the device. While swapped out, a sequence's `block_table` holds host block ids. Both
functions change only the bookkeeping and return the copies to make, as (source block, destination block) pairs
that the model runner executes before the step's forward pass (`transfer.swap_blocks`).

Where this lives in vLLM: `vllm/core/block_manager.py` (vLLM v0's `BlockSpaceManager.swap_out` / `swap_in`, which
return the same mapping; the CPU pool is its `cpu_allocator`).
"""

from solutions.core.block_pool import BlockPool, KVCacheBlock
from solutions.core.sequence import Sequence


def num_group_blocks(seqs: list[Sequence]) -> int:
    """The distinct blocks the group's block tables hold (a block shared by several samples counts once)."""
    return len({block_id for seq in seqs for block_id in seq.block_table})


def swap_out(device_pool: BlockPool, host_pool: BlockPool, seqs: list[Sequence]) -> list[tuple[int, int]]:
    """Move the group's blocks to the host: [(device block, host block), ...], one pair per distinct device block.

    Each sequence's table is rewritten to host ids; a device block held by k of the group's sequences maps to one
    host block with `ref_cnt == k`, and the group's k references on the device are dropped (tail first, as `free`
    does). The caller checks that `host_pool` has `num_group_blocks(seqs)` free blocks.
    """
    return _move_group(device_pool, host_pool, seqs)


def swap_in(host_pool: BlockPool, device_pool: BlockPool, seqs: list[Sequence]) -> list[tuple[int, int]]:
    """Bring a swapped-out group back: [(host block, device block), ...], one pair per distinct host block.

    The mirror of `swap_out`: fresh device blocks, shared as the host blocks were, the host references dropped.
    The caller checks that `device_pool` has `num_group_blocks(seqs)` free blocks.
    """
    return _move_group(host_pool, device_pool, seqs)


def _move_group(source: BlockPool, destination: BlockPool, seqs: list[Sequence]) -> list[tuple[int, int]]:
    """`swap_out` and `swap_in`: one fresh `destination` block per distinct `source` block, shared as it was."""
    moved_to: dict[int, KVCacheBlock] = {}
    for seq in seqs:
        old_table = list(seq.block_table)
        for i, block_id in enumerate(old_table):
            block = moved_to.get(block_id)
            if block is None:
                (block,) = destination.get_new_blocks(1)
                moved_to[block_id] = block
            else:
                block.ref_cnt += 1
            seq.block_table[i] = block.block_id
        source.free_blocks(source.blocks[block_id] for block_id in reversed(old_table))
    return [(old_id, block.block_id) for old_id, block in moved_to.items()]
