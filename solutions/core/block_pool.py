"""The pool of physical KV-cache blocks, the queue of free ones, and the prefix cache's hash → block map.

The KV cache is one preallocated tensor cut into `num_blocks` blocks of `block_size` token slots each. This
module only does the bookkeeping: which blocks are free, how many owners each used block has, and which full
blocks hold a known prefix (chapter 4). It never touches tensors, so it runs (and is tested) without a model.

Where this lives in vLLM: `vllm/v1/core/kv_cache_utils.py` (`KVCacheBlock`, `FreeKVCacheBlockQueue`) and
`vllm/v1/core/block_pool.py` (`BlockPool`). vLLM also reserves block 0 as a "null block" (a placeholder for
skipped blocks, e.g. outside a sliding window); nothing here needs one, so every block is usable.
"""

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one physical block; `block_id` indexes the cache tensor's block dimension.

    `ref_cnt` counts the sequences whose block tables hold this block (more than one once blocks are shared by
    forks and prefix caching). `prev_free_block`/`next_free_block` are the links of the free queue, stored on the
    block itself so that removing it from the middle of the queue is O(1). `block_hash` is set while the block is
    a full block registered in the prefix cache — it survives `free` (that is the point: a later prompt with the
    same prefix revives the block) and is dropped only when the block is handed out for other tokens (evicted).
    Compared by identity (`eq=False`): two blocks are never "equal".
    """

    block_id: int
    ref_cnt: int = 0
    prev_free_block: "KVCacheBlock | None" = None
    next_free_block: "KVCacheBlock | None" = None
    block_hash: bytes | None = None

    def __repr__(self) -> str:  # the links would print the whole queue
        cached = "" if self.block_hash is None else f", block_hash={self.block_hash[:4].hex()}…"
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, in eviction order: the head is handed out first.

    Why not a `deque`: prefix caching (a later chapter) revives a freed block that still holds a useful prefix,
    which means taking it out of the *middle* of the queue; with links on the blocks that is O(1), with a deque
    it is O(n). Freed blocks go to the tail, so the head is always the least recently freed block (LRU).

    Two sentinel blocks (`head`, `tail`, block_id -1) bracket the list, so no operation special-cases an empty
    queue or an end. Invariant: a block is in the queue ⇔ both its links are set.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(block_id=-1)
        self.tail = KVCacheBlock(block_id=-1)
        self.head.next_free_block = self.tail
        self.tail.prev_free_block = self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Take the block at the head (the least recently freed)."""
        block = self.head.next_free_block
        if block is self.tail:
            raise RuntimeError("popleft from an empty free block queue")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (it will be handed out last)."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"block {block.block_id} is already in the free block queue")
        last = self.tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.tail
        self.tail.prev_free_block = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from wherever it sits, in O(1)."""
        prev, next_ = block.prev_free_block, block.next_free_block
        if prev is None or next_ is None:
            raise RuntimeError(f"block {block.block_id} is not in the free block queue")
        prev.next_free_block = next_
        next_.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks from head to tail (O(n); for tests and pictures)."""
        blocks = []
        block = self.head.next_free_block
        while block is not self.tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks


class BlockPool:
    """Owns every `KVCacheBlock`; hands out free blocks, takes them back, and remembers which hold a prefix.

    Invariants:
    - `ref_cnt == 0` ⇔ the block is in the free queue. `get_new_blocks` moves blocks out of the queue with
      `ref_cnt = 1`; `free_blocks` decrements and returns a block to the queue's tail when its count reaches 0.
    - `cached_block_hash_to_block[h] is b` ⇔ `b.block_hash == h`: a full block whose contents are known. A
      cached block may be free (ref_cnt 0, still in the queue): it counts as free, and stays reusable until
      `get_new_blocks` takes it from the head of the queue for other tokens — only then is its hash dropped
      (evicted). Since freed blocks join the tail, the least recently freed cached block is evicted first (LRU).
    - `touch` revives a cached block: out of the middle of the free queue (O(1), the reason the queue is a
      linked list) if nobody held it, and one more reference either way.
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        # called with (block_id, block_hash) when `get_new_blocks` evicts a cached block (chapter 11's host tier)
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue, each with `ref_cnt == 1`.

        A block taken from the queue will hold other tokens, so if it was cached its hash is evicted first:
        the map must never point at a block whose contents are about to change.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.num_free_blocks} of "
                             f"{self.num_blocks} are free")
        blocks = [self.free_block_queue.popleft() for _ in range(num_blocks)]
        for block in blocks:
            assert block.ref_cnt == 0, f"block {block.block_id} was in the free queue with ref_cnt {block.ref_cnt}"
            if block.block_hash is not None and self.on_evict is not None:
                self.on_evict(block.block_id, block.block_hash)
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks reaching 0 join the free queue's tail in the given order.

        Pass a sequence's blocks tail first: the tail of a sequence is the least likely to be reused by a later
        prefix hit, so it should be evicted first. Freed blocks keep their hash. Checks every block before
        changing any, so a double free raises without corrupting the pool.
        """
        blocks = list(blocks)
        for block_id, num_refs in Counter(block.block_id for block in blocks).items():
            block = self.blocks[block_id]
            if num_refs > block.ref_cnt:
                raise RuntimeError(f"block {block_id} freed {num_refs} time(s) but its ref_cnt is "
                                   f"{block.ref_cnt} (double free?)")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit: one more reference to each block, reviving free ones out of the middle of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """The block holding the full block with this hash, free or not; None if no block does (a miss)."""
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full, held block under its hash, so later prompts with the same prefix can share it.

        If another block already holds that prefix (two sequences computed it before either was cached), the
        first stays the cached one and this block stays uncached: one hash, one block.
        """
        if block.ref_cnt == 0:
            raise RuntimeError(f"block {block.block_id} is free; only a held block can be cached")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise RuntimeError(f"block {block.block_id} is already cached under another hash")
            return
        if block_hash not in self.cached_block_hash_to_block:
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        """Forget a block's hash (its contents are about to be overwritten or were never computed)."""
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None
