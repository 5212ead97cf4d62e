"""The prefix cache's second tier: blocks the device pool evicts are kept in a host pool, and loaded back on a hit.

A freed full block stays cached in the device pool until `get_new_blocks` hands it out for other tokens (chapter
4); the pool reports that eviction (`on_evict`), and when the step's batch is decided (`take_transfers`),
`prepare_store` copies each evicted block to a host block registered under the same hash. The host pool is a
`BlockPool` too, so its free queue makes it LRU. At admission, past the device's own hits,
`get_num_new_matched_tokens` counts the host's and `prepare_load` copies them back instead of recomputing them.
A host block a step reads or writes is held (`ref_cnt` 1) until the step has run (`complete_transfers`), so no
store overwrites it first. The copies leave in the `SchedulerOutput`; the runner makes the stores before the loads.

Where this lives in vLLM: `vllm/v1/kv_offload/cpu/manager.py` (`CPUOffloadingManager`: `lookup`, `prepare_load`,
`touch`, `complete_load`, `prepare_store`, `complete_store`; LRU in `cpu/policies/lru.py`). vLLM stores every new
full block as it is computed (write-through); here a block is stored when the device evicts it (write-back).
"""

from dataclasses import dataclass

from solutions.core.block_pool import BlockPool, KVCacheBlock


@dataclass(slots=True)
class OffloadingStats:
    """Host-tier prefix lookups, in tokens (vLLM: `vllm:external_prefix_cache_queries` / `_hits`), and blocks moved."""

    queries: int = 0  # prompt tokens looked up on the host (past the device's hits)
    hits: int = 0  # of those, found on the host
    num_blocks_stored: int = 0
    num_blocks_loaded: int = 0


class CPUOffloadingManager:
    """A host `BlockPool` keyed by block hash, and the store / load pairs of the step being scheduled."""

    def __init__(self, num_blocks: int) -> None:
        self.host_pool = BlockPool(num_blocks)
        self.stats = OffloadingStats()
        self._evicted: list[tuple[int, bytes]] = []  # (device block, hash) the device evicted this step
        self._stores: list[tuple[int, int]] = []  # (device block, host block) this step
        self._loads: list[tuple[int, int]] = []  # (host block, device block) this step
        self._held: list[KVCacheBlock] = []  # host blocks this step reads or writes

    def on_evict(self, device_block_id: int, block_hash: bytes) -> None:
        """The device pool is handing out `device_block_id`, a computed block under `block_hash`: store it this step."""
        self._evicted.append((device_block_id, block_hash))

    def lookup(self, block_hashes: list[bytes]) -> int:
        """How many of these chained hashes, from the first, the host holds (the first miss ends the run)."""
        misses = (i for i, block_hash in enumerate(block_hashes) if self.host_pool.get_cached_block(block_hash) is None)
        return next(misses, len(block_hashes))

    def touch(self, block_hashes: list[bytes]) -> None:
        """Mark the host blocks under these hashes (a prefix's run, first block first) most recently used: an unheld
        one moves to the LRU tail, the prefix's first block last (evicted last). Holds nothing."""
        for block_hash in reversed(block_hashes):
            if (block := self._host_block(block_hash)).ref_cnt == 0:
                self.host_pool.free_block_queue.remove(block)
                self.host_pool.free_block_queue.append(block)

    def prepare_load(self, block_hashes: list[bytes], device_block_ids: list[int]) -> None:
        """Load the host blocks under `block_hashes` into these device blocks; each is held until the step has run."""
        for block_hash, device_block_id in zip(block_hashes, device_block_ids, strict=True):
            host = self._host_block(block_hash)
            self.host_pool.touch([host])
            self._held.append(host)
            self._loads.append((host.block_id, device_block_id))
        self.stats.num_blocks_loaded += len(device_block_ids)

    def _host_block(self, block_hash: bytes) -> KVCacheBlock:
        if (block := self.host_pool.get_cached_block(block_hash)) is None:
            raise RuntimeError(f"block hash {block_hash[:4].hex()}… is not on the host; look it up first")
        return block

    def queue_store(self, device_block_id: int, host: KVCacheBlock) -> None:
        """Copy device block `device_block_id` into `host` (taken and registered by the caller) before this step's
        forward pass; `host` is held until the step has run, so no other store this step takes it."""
        self._held.append(host)
        self._stores.append((device_block_id, host.block_id))
        self.stats.num_blocks_stored += 1

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's batch is decided: prepare the stores of its evictions (after its loads are held), and hand over
        the step's (stores, loads) for its `SchedulerOutput`; cleared here."""
        prepare_store(self, self._evicted)  # looked up in this module when called (chapter 11's exercise)
        transfers = self._stores, self._loads
        self._evicted, self._stores, self._loads = [], [], []
        return transfers

    def complete_transfers(self) -> None:
        """The previous step has run (vLLM: `complete_load`, `complete_store`): its host blocks are no longer held (they
        stay cached, at the LRU tail)."""
        self.host_pool.free_blocks(self._held)
        self._held = []


def prepare_store(offloading: CPUOffloadingManager, evicted: list[tuple[int, bytes]]) -> None:
    """The device evicted these computed blocks this step, (device block, hash) in eviction order: keep a host copy of
    each (vLLM: `CPUOffloadingManager.prepare_store`, which evicts by its LRU policy and protects what it stores until
    `complete_store`).

    A hash the host holds already is only touched: the device's use of it was more recent than the host's. Otherwise
    the host's least recently used block that no transfer of this step holds gives way (`get_new_blocks` takes the
    head of the host's free queue, evicting its hash), is registered under the new hash and queued (held until the
    step has run); with every host block held this step, the store is dropped — a cache may forget.
    """
    for device_block_id, block_hash in evicted:
        if offloading.host_pool.get_cached_block(block_hash) is not None:
            offloading.touch([block_hash])
            continue
        if offloading.host_pool.num_free_blocks == 0:
            continue
        (host,) = offloading.host_pool.get_new_blocks(1)
        offloading.host_pool.cache_full_block(host, block_hash)
        offloading.queue_store(device_block_id, host)


def get_num_new_matched_tokens(
    offloading: CPUOffloadingManager, block_hashes: list[bytes], num_tokens: int, num_computed_tokens: int,
    block_size: int,
) -> int:
    """At admission, after the device's prefix lookup found `num_computed_tokens`: how many more tokens the host tier
    holds (vLLM: the offloading connector's `get_num_new_matched_tokens`).

    The host's run starts at the first block the device missed and ends at the host's first miss, and, like the
    device's, never covers the last token (the forward pass must compute one, to sample from). The hits are marked
    most recently used (`touch`); nothing is held here: `prepare_load` holds what is loaded, so a sequence that is not
    admitted after all holds nothing. Counted in `offloading.stats`, in tokens: the queries are the tokens past the
    device's hits.
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
