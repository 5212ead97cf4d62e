"""The prefix cache's second tier: blocks the device pool evicts are kept in a host pool, and loaded back on a hit.

The device pool keeps a freed full block cached until `get_new_blocks` hands it out for other tokens (chapter 4):
that eviction is where this tier comes in. `prepare_store` copies the evicted block to a host block registered under
the same hash; the host pool is a `BlockPool` too, so its free queue makes the host side LRU (a stored block goes to
the tail; the head is overwritten first). At admission, after the device's own lookup, `lookup` counts how many of
the prompt's next blocks the host holds; the scheduler allocates device blocks for them and `prepare_load` copies
them back instead of recomputing them.

A host block that a step reads or writes is held (`ref_cnt` 1) until the step has run (`complete_transfers`, called
when the next step is scheduled), so no later eviction in the same step can reuse it. The step's copies leave with
`take_transfers` in the `SchedulerOutput`; the runner makes the stores before the loads (a block stored and loaded
in one step is read after it is written).

Where this lives in vLLM: `vllm/v1/kv_offload/cpu/manager.py` (`CPUOffloadingManager`: `lookup`, `prepare_load`,
`complete_load`, `prepare_store`, `complete_store`; LRU in `cpu/policies/lru.py`). vLLM stores every new full
block as it is computed (write-through); here a block is stored when the device evicts it (write-back), so the host
holds only what the device lost.
"""

from dataclasses import dataclass

from solutions.core.block_pool import BlockPool, KVCacheBlock


@dataclass(slots=True)
class OffloadingStats:
    """Host-tier prefix lookups, in tokens (vLLM: `vllm:external_prefix_cache_queries` / `_hits`), and blocks moved."""

    queries: int = 0  # prompt tokens looked up on the host (past the device's hits)
    hits: int = 0  # of those, found on the host and loaded
    num_blocks_stored: int = 0
    num_blocks_loaded: int = 0


class CPUOffloadingManager:
    """A host `BlockPool` keyed by block hash, and the store / load pairs of the step being scheduled."""

    def __init__(self, num_blocks: int) -> None:
        self.host_pool = BlockPool(num_blocks)
        self.stats = OffloadingStats()
        self._stores: list[tuple[int, int]] = []  # (device block, host block) this step
        self._loads: list[tuple[int, int]] = []  # (host block, device block) this step
        self._held: list[KVCacheBlock] = []  # host blocks this step reads or writes

    def lookup(self, block_hashes: list[bytes]) -> int:
        """How many of these chained hashes, from the first, the host holds (the first miss ends the run)."""
        num_hits = 0
        for block_hash in block_hashes:
            if self.host_pool.get_cached_block(block_hash) is None:
                break
            num_hits += 1
        return num_hits

    def prepare_store(self, device_block_id: int, block_hash: bytes) -> None:
        """The device pool is evicting `device_block_id`, a computed block under `block_hash`: keep a copy on the host.

        A hash the host already holds is only moved to the LRU tail. Otherwise the host's least recently used free
        block is taken (evicting its own hash), registered and held until the step has run; with every host block
        held by this step, the store is dropped (a cache may forget).
        """
        cached = self.host_pool.get_cached_block(block_hash)
        if cached is not None:
            if cached.ref_cnt == 0:  # most recently used now
                self.host_pool.free_block_queue.remove(cached)
                self.host_pool.free_block_queue.append(cached)
            return
        if self.host_pool.num_free_blocks == 0:
            return
        (host,) = self.host_pool.get_new_blocks(1)
        self.host_pool.cache_full_block(host, block_hash)
        self._held.append(host)
        self._stores.append((device_block_id, host.block_id))
        self.stats.num_blocks_stored += 1

    def touch(self, block_hashes: list[bytes]) -> None:
        """Hold the host blocks under these hashes (hits of `lookup`) until the step has run; they are the most
        recently used once it has."""
        blocks = [self.host_pool.get_cached_block(block_hash) for block_hash in block_hashes]
        if None in blocks:
            raise RuntimeError("a block hash to touch is not on the host; look it up first")
        self.host_pool.touch(blocks)
        self._held += blocks

    def prepare_load(self, block_hashes: list[bytes], device_block_ids: list[int]) -> None:
        """Load the host blocks under `block_hashes` (held by `touch` this step) into these device blocks."""
        for block_hash, device_block_id in zip(block_hashes, device_block_ids, strict=True):
            host = self.host_pool.get_cached_block(block_hash)
            if host is None or host.ref_cnt == 0:
                raise RuntimeError(f"block hash {block_hash[:4].hex()}… is not held on the host; touch it first")
            self._loads.append((host.block_id, device_block_id))
        self.stats.num_blocks_loaded += len(device_block_ids)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (stores, loads), for its `SchedulerOutput`; cleared here."""
        transfers = self._stores, self._loads
        self._stores, self._loads = [], []
        return transfers

    def complete_transfers(self) -> None:
        """The previous step has run: its host blocks are no longer held (they stay cached, at the LRU tail)."""
        self.host_pool.free_blocks(self._held)
        self._held = []


def get_num_new_matched_tokens(
    offloading: CPUOffloadingManager, block_hashes: list[bytes], num_tokens: int, num_computed_tokens: int,
    block_size: int,
) -> int:
    """At admission, after the device's prefix lookup found `num_computed_tokens`: how many more tokens the host tier
    holds (vLLM: the offloading connector's `get_num_new_matched_tokens`).

    The host's run starts at the first block the device missed and ends at the host's first miss, and, like the
    device's, never covers the last token (the forward pass must compute one, to sample from). The hits are held
    until the step has run, so no store this step overwrites them before they are loaded. Counted in
    `offloading.stats`, in tokens: the queries are the tokens past the device's hits.
    """
    first = num_computed_tokens // block_size
    last = (num_tokens - 1) // block_size  # full blocks strictly before the last token
    hits = block_hashes[first : first + offloading.lookup(block_hashes[first:last])]
    offloading.touch(hits)
    offloading.stats.queries += num_tokens - num_computed_tokens
    offloading.stats.hits += len(hits) * block_size
    return len(hits) * block_size


def update_state_after_alloc(
    offloading: CPUOffloadingManager, block_hashes: list[bytes], block_table: list[int], num_computed_tokens: int,
    num_external_tokens: int, block_size: int,
) -> None:
    """The scheduler allocated device blocks for the host's hits (after the device's `num_computed_tokens`): load each
    hit into the block that now holds its position (vLLM: the connector's `update_state_after_alloc`)."""
    first, num_blocks = num_computed_tokens // block_size, num_external_tokens // block_size
    offloading.prepare_load(block_hashes[first : first + num_blocks], block_table[first : first + num_blocks])
