"""Sharing KV blocks: reference counts, fork, copy-on-write, and prefix caching.

Chapter 3's `BlockManager` gave every sequence blocks of its own. Here several block tables may point at the
same physical block, and the block's `ref_cnt` counts them:

- fork: a child sequence (another sample, a beam) starts with its parent's block table, every block's `ref_cnt`
  + 1, so the prompt's keys and values are stored once;
- copy-on-write (the paper's §4.4): a sequence about to write into a block another sequence holds first gets its
  own, and the step records a copy (source → destination) that the runner makes before the forward pass. Only a
  *partial* last block is ever written again, so full blocks stay shared forever;
- prefix caching: every full block is registered under its chained hash (`block_hash.py`); a prompt whose leading
  blocks hash the same reuses them (`get_computed_blocks`). Freed blocks keep their hash until handed out again,
  so the cache costs no memory.

Invariants (property-tested): a block's `ref_cnt` is the number of tables holding it, 0 ⇔ in the free queue; a
cached block holds exactly the tokens its hash covers; once every sequence is freed, every block is free.

Where this lives in vLLM: `vllm/v1/core/kv_cache_manager.py` (`KVCacheManager.get_computed_blocks`,
`allocate_slots`, `free`), `vllm/v1/core/block_pool.py`; copy-on-write and fork are vLLM v0's
(vLLM v0: `vllm/core/block_manager.py`: `fork`, `append_slots` returning the copies; `cache_engine.copy_blocks`) —
vLLM v1 runs n samples as separate requests and shares their prompt through the prefix cache instead.
"""

from dataclasses import dataclass

from solutions.core.block_hash import extend_block_hashes
from solutions.core.block_manager import BlockManager
from solutions.core.block_pool import BlockPool, KVCacheBlock
from solutions.core.sequence import Sequence
from solutions.kv_offload.manager import CPUOffloadingManager
from solutions.kv_offload.swap import swap_in, swap_out
from solutions.utils.math_utils import cdiv


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups, counted in tokens: `queries` prompt tokens asked about, `hits` found cached."""

    num_requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of the prompt tokens looked up that were found in the cache (0.0 before any lookup)."""
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager(BlockManager):
    """Block tables that share blocks: fork, copy-on-write, prefix caching. The engine calls `allocate_slots`.

    Two ways in, the same bookkeeping:
    - `allocate_slots(seq, num_new_tokens, new_computed_blocks)` — the engine's verb (vLLM v1): room for the
      next chunk of any size, prefix hits, copy-on-write, registration of newly full blocks; None when the
      blocks are not there (nothing changed; the scheduler preempts and retries);
    - `append_slot(seq)` — vLLM v0's decode verb, after `seq.append_token`: room for the one newest token.
    Both return the copies to make, `[(src_block, dst_block), ...]`, and count them in `num_blocks_copied`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size)
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_blocks_copied = 0  # copy-on-write copies made (each: one block, every layer, K and V)
        # chapter 11, host memory behind the device pool (None: off): the prefix cache's host tier, and the pool
        # preempted groups are swapped out to
        self.offloading: CPUOffloadingManager | None = None
        self.swap_pool: BlockPool | None = None

    def enable_offloading(self, num_host_blocks: int) -> None:
        """Chapter 11: keep the blocks the device pool evicts in a host pool of `num_host_blocks` (LRU there)."""
        if not self.enable_prefix_caching:
            raise ValueError("the host tier keeps blocks by their prefix hash: it needs enable_prefix_caching=True")
        self.offloading = CPUOffloadingManager(num_host_blocks)
        self.block_pool.on_evict = self.offloading.on_evict

    def enable_swapping(self, num_swap_blocks: int) -> None:
        """Chapter 11: a host pool of `num_swap_blocks` for preempted groups swapped out whole. The manager owns the
        pool and is the only one to take or free its blocks; which group goes and when it comes back is the
        scheduler's (`SwappingScheduler`)."""
        self.swap_pool = BlockPool(num_swap_blocks)

    def swap_out(self, group: list[Sequence]) -> list[tuple[int, int]]:
        """Move `group`'s blocks to the swap pool (`kv_offload/swap.py`): the (device, host) block copies to make."""
        return swap_out(self.block_pool, self.swap_pool, group)

    def swap_in(self, group: list[Sequence]) -> list[tuple[int, int]]:
        """Bring swapped-out `group`'s blocks back to the device: the (host, device) block copies to make."""
        return swap_in(self.swap_pool, self.block_pool, group)

    def free_swapped(self, seq: Sequence) -> None:
        """`free` for a sequence that is swapped out: its block table holds host blocks, last block first."""
        self.swap_pool.free_blocks(self.swap_pool.blocks[block_id] for block_id in reversed(seq.block_table))
        seq.block_table.clear()

    # sharing ------------------------------------------------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent`: the same block table, each block's `ref_cnt` + 1."""
        if child.block_table:
            raise ValueError(f"child sequence {child.seq_id} already holds {len(child.block_table)} blocks")
        blocks = [self.block_pool.blocks[block_id] for block_id in parent.block_table]
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"sequence {parent.seq_id} holds block {block.block_id}, "
                                   f"whose ref_cnt is {block.ref_cnt}")
            block.ref_cnt += 1
        child.block_table.extend(parent.block_table)

    def copy_on_write(self, seq: Sequence, logical_block: int) -> tuple[int, int]:
        """Give `seq` a private copy of its block `logical_block`, which it shares: returns (src, dst).

        Takes a fresh block, puts it in `seq.block_table` in place of the shared one and drops `seq`'s
        reference to the shared one (the others keep it). The caller checks that a free block exists; the
        model runner copies the contents (`copy_blocks`) before this step's forward pass writes into dst.
        """
        src = self.block_pool.blocks[seq.block_table[logical_block]]
        if src.ref_cnt < 2:
            raise RuntimeError(f"block {src.block_id} of sequence {seq.seq_id} is not shared (ref_cnt {src.ref_cnt})")
        (dst,) = self.block_pool.get_new_blocks(1)
        seq.block_table[logical_block] = dst.block_id
        self.block_pool.free_blocks([src])
        self.num_blocks_copied += 1
        return src.block_id, dst.block_id

    def can_append_slot(self, seq: Sequence) -> bool:
        """After `append_token`: is there a free block for the newest token if it needs one (new or copied)?"""
        return self._num_blocks_for_newest_token(seq) <= self.num_free_blocks

    def append_slot(self, seq: Sequence) -> list[tuple[int, int]]:
        """After `append_token`, make room for the newest token; returns the copy-on-write copies (0 or 1).

        A token that starts a block gets a new block. A token written into a block another sequence holds
        triggers copy-on-write. Otherwise it has its slot already. Raises ValueError if a block is needed and
        none is free (ask `can_append_slot` first).
        """
        if self._num_blocks_for_newest_token(seq) > self.num_free_blocks:
            raise ValueError(f"cannot append a slot to sequence {seq.seq_id}: token {seq.num_tokens} needs a block and "
                             f"0 of {self.num_blocks} blocks are free")
        last = (seq.num_tokens - 1) // self.block_size  # logical block of the newest token
        if last == len(seq.block_table):
            seq.block_table.extend(block.block_id for block in self.block_pool.get_new_blocks(1))
            return []
        if self.block_pool.blocks[seq.block_table[last]].ref_cnt > 1:
            return [self.copy_on_write(seq, last)]
        return []

    def _num_blocks_for_newest_token(self, seq: Sequence) -> int:
        if not seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} holds no blocks; allocate it before decoding")
        last = (seq.num_tokens - 1) // self.block_size
        if last > len(seq.block_table) or last < len(seq.block_table) - 1:
            raise RuntimeError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens but {len(seq.block_table)} blocks of "
                f"{self.block_size}: append_slot covers one new token per call"
            )
        if last == len(seq.block_table):
            return 1
        return int(self.block_pool.blocks[seq.block_table[last]].ref_cnt > 1)

    # prefix caching -----------------------------------------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVCacheBlock], int]:
        """The longest run of `seq`'s leading full blocks already in the cache, and the tokens they hold.

        Never covers the last token: the forward pass must compute at least one token, to produce the logits
        the next token is sampled from — so a prompt of exactly k full blocks can hit at most k - 1 of them.
        Counts the lookup in `prefix_cache_stats`; changes no block (`allocate_slots` touches the hits). A sequence
        that must compute its whole prompt (`seq.skip_reading_prefix_cache`: it wants the prompt's logprobs) finds
        nothing and is not counted, as in vLLM.
        """
        if not self.enable_prefix_caching or seq.skip_reading_prefix_cache:
            return [], 0
        extend_block_hashes(seq.block_hashes, seq.token_ids, seq.num_tokens, self.block_size)
        max_blocks = (seq.num_tokens - 1) // self.block_size  # full blocks strictly before the last token
        hits: list[KVCacheBlock] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break  # chained hashes: after a miss, no later block can be a hit
            hits.append(block)
        num_computed_tokens = len(hits) * self.block_size
        self.prefix_cache_stats.num_requests += 1
        self.prefix_cache_stats.queries += seq.num_tokens
        self.prefix_cache_stats.hits += num_computed_tokens
        return hits, num_computed_tokens

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[tuple[int, int]] | None:
        """Room for `seq`'s next `num_new_tokens` tokens, after its computed (and newly cached) ones.

        Afterwards `seq.block_table` covers `seq.num_computed_tokens + len(new_computed_blocks) * block_size +
        num_new_tokens` tokens: the prefix hits first (only for a sequence that holds no blocks yet), then the
        blocks it had, then fresh ones. If the block the first new token goes into already holds data and is
        shared, it is copied on write. With prefix caching on, every block these tokens fill is registered
        under its hash (its K/V are written by this step's forward pass, before any later step reads them; a
        sequence scheduled in the same step reads them in the same layer after they are written).
        Returns the copies to make, or None — changing nothing — if the free blocks do not suffice.
        `seq.num_computed_tokens` is not changed: the scheduler adds the cached tokens, the runner the rest.

        The new tokens may run past `seq.num_tokens` into its draft tokens (`seq.spec_token_ids`, speculative
        decoding): they get slots, but only blocks full of the sequence's own tokens are registered — a draft may
        be rejected, and a block holding one must never be found by a prefix hit.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        new_computed_blocks = new_computed_blocks or []
        if new_computed_blocks and seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} holds blocks already; prefix hits only go into an empty table")
        bs = self.block_size
        first_new = seq.num_computed_tokens + len(new_computed_blocks) * bs  # position of the first new token
        num_tokens = first_new + num_new_tokens
        if num_tokens > seq.num_tokens + len(seq.spec_token_ids):
            raise ValueError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens and {len(seq.spec_token_ids)} draft tokens; "
                f"cannot schedule up to position {num_tokens}"
            )
        num_table_blocks = len(seq.block_table) + len(new_computed_blocks)
        cow_block = first_new // bs  # the block written first; copy it if it holds data and is shared
        needs_cow = (
            num_new_tokens > 0
            and first_new % bs != 0
            and cow_block < len(seq.block_table)
            and self.block_pool.blocks[seq.block_table[cow_block]].ref_cnt > 1
        )
        num_fresh = max(cdiv(num_tokens, bs) - num_table_blocks, 0) + int(needs_cow)
        num_revived = sum(block.ref_cnt == 0 for block in new_computed_blocks)  # leave the free queue
        if num_fresh > self.num_free_blocks - num_revived:
            return None

        self.block_pool.touch(new_computed_blocks)
        seq.block_table.extend(block.block_id for block in new_computed_blocks)
        copies = [self.copy_on_write(seq, cow_block)] if needs_cow else []
        seq.block_table.extend(block.block_id for block in self.block_pool.get_new_blocks(num_fresh - int(needs_cow)))
        if self.enable_prefix_caching:
            self._cache_full_blocks(seq, first_block=first_new // bs, num_tokens=min(num_tokens, seq.num_tokens))
        return copies

    def cache_blocks(self, seq: Sequence, start: int, num_tokens: int) -> None:
        """After a speculative step: register `seq`'s blocks from the one holding position `start` that are full
        within its first `num_tokens` tokens, all verified and computed (the blocks its accepted drafts filled).
        Nothing without prefix caching."""
        if self.enable_prefix_caching:
            self._cache_full_blocks(seq, first_block=start // self.block_size, num_tokens=num_tokens)

    def free_uncomputed_blocks(self, seq: Sequence) -> None:
        """Before `seq` is swapped out (chapter 11): free the blocks past its computed tokens (this step allocated them
        for tokens that will now not run) and forget a hash registered for a block those tokens would have filled."""
        bs = self.block_size
        num_kept = cdiv(seq.num_computed_tokens, bs)
        blocks = [self.block_pool.blocks[block_id] for block_id in seq.block_table]
        self.block_pool.free_blocks(reversed(blocks[num_kept:]))
        del seq.block_table[num_kept:]
        uncomputed = blocks[seq.num_computed_tokens // bs :]
        for block in uncomputed:
            if block.ref_cnt <= 1:  # nobody else holds it: its hash covers tokens that were never computed
                self.block_pool._maybe_evict_cached_block(block)

    def _cache_full_blocks(self, seq: Sequence, first_block: int, num_tokens: int) -> None:
        """Register blocks `first_block ..` that are full once `num_tokens` tokens are in (keeps `block_hashes`)."""
        extend_block_hashes(seq.block_hashes, seq.token_ids, num_tokens, self.block_size)
        for i in range(first_block, num_tokens // self.block_size):
            self.block_pool.cache_full_block(self.block_pool.blocks[seq.block_table[i]], seq.block_hashes[i])

    # finish -------------------------------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s reference to each of its blocks, last block first, and clear its block table.

        Blocks nobody else holds join the free queue, keeping their hashes for later hits. One exception: a
        block registered by `allocate_slots` whose tokens were never computed (the sequence was preempted
        before its forward pass ran) must not be found by a later hit, so its hash is dropped. Free a sequence
        before resetting its `num_computed_tokens`; otherwise its blocks are only forgotten, never wrong.
        """
        blocks = [self.block_pool.blocks[block_id] for block_id in seq.block_table]
        num_computed_blocks = seq.num_computed_tokens // self.block_size
        self.block_pool.free_blocks(reversed(blocks))
        for block in blocks[num_computed_blocks:]:
            if block.ref_cnt == 0:
                self.block_pool._maybe_evict_cached_block(block)
        seq.block_table.clear()
