"""Data parallelism: one KV cache manager over N block pools, one pool per model replica.

A block id means (replica, id): each pool (`replicas[r]`, a `KVCacheManager`) has its own free queue, prefix-cache
hash map and reference counts. A sequence holds blocks of `seq.replica`'s pool only, for life (preemption,
swapping and forks stay there), so "free" is per pool: that is why the scheduler preempts within a replica and
placement asks how much of a prompt each pool holds (`num_cached_blocks`). A dead replica's pool (`mark_gone`)
counts in no total, and nothing is placed there again.

Where this lives in vLLM: nowhere as one object — each data-parallel rank is a whole engine core with its own
`KVCacheManager`, balanced by a front end that sees no cache; SGLang's router (`sgl-model-gateway`,
`src/policies/cache_aware.rs`, read 2026-12-03 at b93974f) sees only the text it routed.
"""

from solutions.core.block_hash import extend_block_hashes
from solutions.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from solutions.core.sequence import Sequence


class DataParallelKVCacheManager:
    """The replicas' `KVCacheManager`s, one pool each; totals over the live ones. Invariant: every block a sequence
    holds is in `replicas[seq.replica]`'s pool."""

    def __init__(self, replicas: list[KVCacheManager]) -> None:
        if not replicas:
            raise ValueError("a data-parallel KV cache manager needs at least one replica's pool")
        self.replicas = replicas
        self.alive = [True] * len(replicas)

    @property
    def block_size(self) -> int:
        return self.replicas[0].block_size

    @property
    def live_replicas(self) -> list[int]:
        return [r for r, alive in enumerate(self.alive) if alive]

    @property
    def num_blocks(self) -> int:
        return sum(self.replicas[r].num_blocks for r in self.live_replicas)

    @property
    def num_free_blocks(self) -> int:
        return sum(self.replicas[r].num_free_blocks for r in self.live_replicas)

    @property
    def num_used_blocks(self) -> int:
        return sum(self.replicas[r].num_used_blocks for r in self.live_replicas)

    @property
    def num_blocks_copied(self) -> int:
        return sum(manager.num_blocks_copied for manager in self.replicas)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Every pool's lookups, summed (a new record: the pools keep their own)."""
        stats = [manager.prefix_cache_stats for manager in self.replicas]
        return PrefixCacheStats(sum(s.num_requests for s in stats), sum(s.queries for s in stats),
                                sum(s.hits for s in stats))

    def mark_gone(self, replica: int) -> None:
        """Replica `replica`'s process died: its pool takes no sequence and counts in no total from now on."""
        if not self.alive[replica]:
            raise RuntimeError(f"replica {replica} is already gone")
        self.alive[replica] = False

    def num_cached_blocks(self, seq: Sequence) -> list[int]:
        """`num_cached_blocks(self, seq)`, looked up in this module when called (chapter 12's decision)."""
        return num_cached_blocks(self, seq)


def num_cached_blocks(manager: DataParallelKVCacheManager, seq: Sequence) -> list[int]:
    """Per replica, how many of `seq`'s leading full blocks its pool holds now (0 on a gone replica): hash lookups
    only — nothing is allocated, touched or counted as a prefix-cache query. As `get_computed_blocks`, the block
    holding the last token never counts (at least one token must be computed)."""
    if not manager.replicas[0].enable_prefix_caching or seq.skip_reading_prefix_cache:
        return [0] * len(manager.replicas)
    extend_block_hashes(seq.block_hashes, seq.token_ids, seq.num_tokens, manager.block_size)
    hashes = seq.block_hashes[: (seq.num_tokens - 1) // manager.block_size]
    counts = []
    for replica, replica_manager in enumerate(manager.replicas):
        count = 0
        if manager.alive[replica]:
            while count < len(hashes) and replica_manager.block_pool.get_cached_block(hashes[count]) is not None:
                count += 1
        counts.append(count)
    return counts
