"""Plausible wrong answers to chapter 11's exercises; each must fail at least one test of its exercise."""

from solutions.core.block_pool import BlockPool, KVCacheBlock
from solutions.core.sched.output import SchedulerOutput
from solutions.core.sched.scheduler import SchedulerBase
from solutions.core.sequence import Sequence
from solutions.kv_offload.manager import CPUOffloadingManager
from solutions.kv_offload.swap import num_group_blocks

# --- swap_out -------------------------------------------------------------------------------------------------------


def swap_out_copies_shared_blocks_per_sample(device_pool: BlockPool, host_pool: BlockPool,
                                             seqs: list[Sequence]) -> list[tuple[int, int]]:
    """Each sequence's blocks copied on their own: a block three samples share is copied three times."""
    pairs = []
    for seq in seqs:
        device_table = list(seq.block_table)
        hosts = host_pool.get_new_blocks(len(device_table))
        pairs += [(d, h.block_id) for d, h in zip(device_table, hosts, strict=True)]
        seq.block_table[:] = [h.block_id for h in hosts]
        device_pool.free_blocks(device_pool.blocks[b] for b in reversed(device_table))
    return pairs


def swap_out_one_host_reference(device_pool: BlockPool, host_pool: BlockPool,
                                seqs: list[Sequence]) -> list[tuple[int, int]]:
    """Shares the host block but leaves its ref_cnt at 1, however many samples hold it."""
    host_of: dict[int, KVCacheBlock] = {}
    for seq in seqs:
        device_table = list(seq.block_table)
        for i, block_id in enumerate(device_table):
            if block_id not in host_of:
                (host_of[block_id],) = host_pool.get_new_blocks(1)
            seq.block_table[i] = host_of[block_id].block_id
        device_pool.free_blocks(device_pool.blocks[b] for b in reversed(device_table))
    return [(d, h.block_id) for d, h in host_of.items()]


def swap_out_keeps_the_device_blocks(device_pool: BlockPool, host_pool: BlockPool,
                                     seqs: list[Sequence]) -> list[tuple[int, int]]:
    """Copies and rewrites the tables, but never drops the group's references on the device."""
    host_of: dict[int, KVCacheBlock] = {}
    for seq in seqs:
        for i, block_id in enumerate(seq.block_table):
            if block_id in host_of:
                host_of[block_id].ref_cnt += 1
            else:
                (host_of[block_id],) = host_pool.get_new_blocks(1)
            seq.block_table[i] = host_of[block_id].block_id
    return [(d, h.block_id) for d, h in host_of.items()]


def swap_out_frees_each_device_block_once(device_pool: BlockPool, host_pool: BlockPool,
                                          seqs: list[Sequence]) -> list[tuple[int, int]]:
    """Drops one device reference per distinct block: a block the three samples shared stays held twice."""
    host_of: dict[int, KVCacheBlock] = {}
    for seq in seqs:
        for i, block_id in enumerate(seq.block_table):
            if block_id in host_of:
                host_of[block_id].ref_cnt += 1
            else:
                (host_of[block_id],) = host_pool.get_new_blocks(1)
            seq.block_table[i] = host_of[block_id].block_id
    device_pool.free_blocks(device_pool.blocks[d] for d in reversed(list(host_of)))
    return [(d, h.block_id) for d, h in host_of.items()]


# --- swap_in --------------------------------------------------------------------------------------------------------


def swap_in_drops_the_sharing(host_pool: BlockPool, device_pool: BlockPool,
                              seqs: list[Sequence]) -> list[tuple[int, int]]:
    """A fresh device block for every table entry: the samples come back with private copies of the prompt."""
    pairs = []
    for seq in seqs:
        host_table = list(seq.block_table)
        devices = device_pool.get_new_blocks(len(host_table))
        pairs += [(h, d.block_id) for h, d in zip(host_table, devices, strict=True)]
        seq.block_table[:] = [d.block_id for d in devices]
        host_pool.free_blocks(host_pool.blocks[b] for b in reversed(host_table))
    return pairs


def swap_in_keyed_by_position(host_pool: BlockPool, device_pool: BlockPool,
                              seqs: list[Sequence]) -> list[tuple[int, int]]:
    """Shares by position in the table, not by host block: the samples' different last blocks all come back into
    the same device block, written three times."""
    device_at: dict[int, KVCacheBlock] = {}
    pairs = []
    for seq in seqs:
        host_table = list(seq.block_table)
        for i, block_id in enumerate(host_table):
            if i in device_at:
                device_at[i].ref_cnt += 1
            else:
                (device_at[i],) = device_pool.get_new_blocks(1)
            pairs.append((block_id, device_at[i].block_id))
            seq.block_table[i] = device_at[i].block_id
        host_pool.free_blocks(host_pool.blocks[b] for b in reversed(host_table))
    return list(dict.fromkeys(pairs))


def swap_in_one_device_reference(host_pool: BlockPool, device_pool: BlockPool,
                                 seqs: list[Sequence]) -> list[tuple[int, int]]:
    """Shares the device block but leaves its ref_cnt at 1: the first sample to finish frees it under the others."""
    device_of: dict[int, KVCacheBlock] = {}
    for seq in seqs:
        host_table = list(seq.block_table)
        for i, block_id in enumerate(host_table):
            if block_id not in device_of:
                (device_of[block_id],) = device_pool.get_new_blocks(1)
            seq.block_table[i] = device_of[block_id].block_id
        host_pool.free_blocks(host_pool.blocks[b] for b in reversed(host_table))
    return [(h, d.block_id) for h, d in device_of.items()]


def swap_in_keeps_the_host_blocks(host_pool: BlockPool, device_pool: BlockPool,
                                  seqs: list[Sequence]) -> list[tuple[int, int]]:
    """Copies back and rewrites the tables, but never frees the host blocks: the swap pool leaks until full."""
    device_of: dict[int, KVCacheBlock] = {}
    for seq in seqs:
        for i, block_id in enumerate(seq.block_table):
            if block_id in device_of:
                device_of[block_id].ref_cnt += 1
            else:
                (device_of[block_id],) = device_pool.get_new_blocks(1)
            seq.block_table[i] = device_of[block_id].block_id
    return [(h, d.block_id) for h, d in device_of.items()]


# --- preempt_group ----------------------------------------------------------------------------------------------------


def _recompute(scheduler: SchedulerBase, victim: Sequence, out: SchedulerOutput,
               copies: dict[int, list[tuple[int, int]]]) -> int:
    returned = scheduler._remove_from_batch(out, victim, copies) if victim in out.scheduled_seqs else 0
    scheduler._preempt_request(victim, out)
    return returned


def _swap_group(scheduler: SchedulerBase, group: list[Sequence], out: SchedulerOutput,
                copies: dict[int, list[tuple[int, int]]], *, read_from: bool = True,
                hand_back: bool = True, free_uncomputed: bool = True) -> int:
    returned, sources = 0, {}
    for seq in group:
        if seq in out.scheduled_seqs:
            if read_from:
                sources.update((dst, src) for src, dst in copies.get(seq.seq_id, []))
            returned += scheduler._remove_from_batch(out, seq, copies)
        if free_uncomputed:
            scheduler.kv_cache_manager.free_uncomputed_blocks(seq)
    scheduler._swap_out(group, out, sources)
    return returned if hand_back else 0


def _fits(scheduler: SchedulerBase, group: list[Sequence]) -> bool:
    num_blocks = num_group_blocks(group)
    return (num_blocks <= scheduler.swap_pool.num_free_blocks
            and num_blocks + len(group) <= scheduler.kv_cache_manager.num_blocks)


def preempt_group_never_checks_the_host(scheduler: SchedulerBase, victim: Sequence, out: SchedulerOutput,
                                        copies: dict[int, list[tuple[int, int]]]) -> int:
    """Always swaps, whether or not the host pool has room (or the group could ever come back)."""
    return _swap_group(scheduler, scheduler.group_of(victim), out, copies)


def preempt_group_checks_the_device_pool(scheduler: SchedulerBase, victim: Sequence, out: SchedulerOutput,
                                         copies: dict[int, list[tuple[int, int]]]) -> int:
    """Looks for room in the wrong pool: the device's free blocks, which a preemption finds all but exhausted, so the
    group is nearly always recomputed (and swapped into a full host pool when the device happens to have room)."""
    group = scheduler.group_of(victim)
    if num_group_blocks(group) > scheduler.kv_cache_manager.num_free_blocks:
        return _recompute(scheduler, victim, out, copies)
    return _swap_group(scheduler, group, out, copies)


def preempt_group_never_recomputes(scheduler: SchedulerBase, victim: Sequence, out: SchedulerOutput,
                                   copies: dict[int, list[tuple[int, int]]]) -> int:
    """Checks for room, but with none preempts nobody: the step waits for a swap that can never happen."""
    group = scheduler.group_of(victim)
    return _swap_group(scheduler, group, out, copies) if _fits(scheduler, group) else 0


def preempt_group_ignores_the_way_back(scheduler: SchedulerBase, victim: Sequence, out: SchedulerOutput,
                                       copies: dict[int, list[tuple[int, int]]]) -> int:
    """Checks the host pool only: swaps out a group too large for the device ever to take back."""
    group = scheduler.group_of(victim)
    if num_group_blocks(group) > scheduler.swap_pool.num_free_blocks:
        return _recompute(scheduler, victim, out, copies)
    return _swap_group(scheduler, group, out, copies)


def preempt_group_recomputes_the_whole_group(scheduler: SchedulerBase, victim: Sequence, out: SchedulerOutput,
                                             copies: dict[int, list[tuple[int, int]]]) -> int:
    """Without room on the host, every sample of the victim's request is recomputed, not the victim alone."""
    group = scheduler.group_of(victim)
    if _fits(scheduler, group):
        return _swap_group(scheduler, group, out, copies)
    return sum(_recompute(scheduler, seq, out, copies) for seq in reversed(group))


def preempt_group_keeps_the_budget(scheduler: SchedulerBase, victim: Sequence, out: SchedulerOutput,
                                   copies: dict[int, list[tuple[int, int]]]) -> int:
    """Takes the group out of the batch but hands back no budget: the step schedules fewer tokens than it could."""
    group = scheduler.group_of(victim)
    if _fits(scheduler, group):
        return _swap_group(scheduler, group, out, copies, hand_back=False)
    return _recompute(scheduler, victim, out, copies)


def preempt_group_forgets_read_from(scheduler: SchedulerBase, victim: Sequence, out: SchedulerOutput,
                                    copies: dict[int, list[tuple[int, int]]]) -> int:
    """Swaps out a copy-on-write destination as it is, though its copy was dropped: garbage goes to the host."""
    group = scheduler.group_of(victim)
    if _fits(scheduler, group):
        return _swap_group(scheduler, group, out, copies, read_from=False)
    return _recompute(scheduler, victim, out, copies)


def preempt_group_swaps_uncomputed_blocks(scheduler: SchedulerBase, victim: Sequence, out: SchedulerOutput,
                                          copies: dict[int, list[tuple[int, int]]]) -> int:
    """Keeps the blocks this step allocated for tokens that will now not run, and swaps them out too."""
    group = scheduler.group_of(victim)
    if _fits(scheduler, group):
        return _swap_group(scheduler, group, out, copies, free_uncomputed=False)
    return _recompute(scheduler, victim, out, copies)


def preempt_group_swaps_the_victim_alone(scheduler: SchedulerBase, victim: Sequence, out: SchedulerOutput,
                                         copies: dict[int, list[tuple[int, int]]]) -> int:
    """Swaps out the victim only, leaving its sister samples running (and the blocks they share on the device)."""
    if _fits(scheduler, [victim]):
        return _swap_group(scheduler, [victim], out, copies)
    return _recompute(scheduler, victim, out, copies)


# --- get_num_new_matched_tokens -------------------------------------------------------------------------------------


def _lookup(offloading: CPUOffloadingManager, hashes: list[bytes], first: int, last: int, *, past_misses: bool = False,
            hold: bool = True) -> list[bytes]:
    if past_misses:
        hits = [h for h in hashes[first:last] if offloading.host_pool.get_cached_block(h) is not None]
    else:
        hits = hashes[first : first + offloading.lookup(hashes[first:last])]
    if hold:
        offloading.touch(hits)
    return hits


def _count(offloading: CPUOffloadingManager, hits: list[bytes], num_tokens: int, num_computed_tokens: int,
           block_size: int) -> int:
    offloading.stats.queries += num_tokens - num_computed_tokens
    offloading.stats.hits += len(hits) * block_size
    return len(hits) * block_size


def lookup_past_the_first_miss(offloading: CPUOffloadingManager, block_hashes: list[bytes], num_tokens: int,
                               num_computed_tokens: int, block_size: int) -> int:
    """Counts every block the host holds, holes included: the tokens after a hole have no K/V to load."""
    first, last = num_computed_tokens // block_size, (num_tokens - 1) // block_size
    hits = _lookup(offloading, block_hashes, first, last, past_misses=True)
    return _count(offloading, hits, num_tokens, num_computed_tokens, block_size)


def lookup_covers_the_last_token(offloading: CPUOffloadingManager, block_hashes: list[bytes], num_tokens: int,
                                 num_computed_tokens: int, block_size: int) -> int:
    """Lets the run reach the last token's block: the step would have nothing to compute and nothing to sample."""
    first, last = num_computed_tokens // block_size, num_tokens // block_size
    hits = _lookup(offloading, block_hashes, first, last)
    return _count(offloading, hits, num_tokens, num_computed_tokens, block_size)


def lookup_does_not_hold_the_hits(offloading: CPUOffloadingManager, block_hashes: list[bytes], num_tokens: int,
                                  num_computed_tokens: int, block_size: int) -> int:
    """Finds the hits but does not hold them: a store later in the same step may overwrite one before it loads."""
    first, last = num_computed_tokens // block_size, (num_tokens - 1) // block_size
    hits = _lookup(offloading, block_hashes, first, last, hold=False)
    return _count(offloading, hits, num_tokens, num_computed_tokens, block_size)


def lookup_from_the_first_block(offloading: CPUOffloadingManager, block_hashes: list[bytes], num_tokens: int,
                                num_computed_tokens: int, block_size: int) -> int:
    """Starts at block 0 instead of after the device's hits: counts (and loads over) blocks the device has."""
    last = (num_tokens - 1) // block_size
    hits = _lookup(offloading, block_hashes, 0, last)
    return _count(offloading, hits, num_tokens, num_computed_tokens, block_size)


def lookup_counts_every_prompt_token(offloading: CPUOffloadingManager, block_hashes: list[bytes], num_tokens: int,
                                     num_computed_tokens: int, block_size: int) -> int:
    """Right answer, wrong statistics: counts the whole prompt as queried, the device's hits included."""
    first, last = num_computed_tokens // block_size, (num_tokens - 1) // block_size
    hits = _lookup(offloading, block_hashes, first, last)
    return _count(offloading, hits, num_tokens, 0, block_size)


MUTANTS = {
    "swap_out_copies_shared_blocks_per_sample": {"swap_out": swap_out_copies_shared_blocks_per_sample},
    "swap_out_one_host_reference": {"swap_out": swap_out_one_host_reference},
    "swap_out_keeps_the_device_blocks": {"swap_out": swap_out_keeps_the_device_blocks},
    "swap_out_frees_each_device_block_once": {"swap_out": swap_out_frees_each_device_block_once},
    "swap_in_drops_the_sharing": {"swap_in": swap_in_drops_the_sharing},
    "swap_in_keyed_by_position": {"swap_in": swap_in_keyed_by_position},
    "swap_in_one_device_reference": {"swap_in": swap_in_one_device_reference},
    "swap_in_keeps_the_host_blocks": {"swap_in": swap_in_keeps_the_host_blocks},
    "preempt_group_never_checks_the_host": {"preempt_group": preempt_group_never_checks_the_host},
    "preempt_group_checks_the_device_pool": {"preempt_group": preempt_group_checks_the_device_pool},
    "preempt_group_never_recomputes": {"preempt_group": preempt_group_never_recomputes},
    "preempt_group_ignores_the_way_back": {"preempt_group": preempt_group_ignores_the_way_back},
    "preempt_group_recomputes_the_whole_group": {"preempt_group": preempt_group_recomputes_the_whole_group},
    "preempt_group_keeps_the_budget": {"preempt_group": preempt_group_keeps_the_budget},
    "preempt_group_forgets_read_from": {"preempt_group": preempt_group_forgets_read_from},
    "preempt_group_swaps_uncomputed_blocks": {"preempt_group": preempt_group_swaps_uncomputed_blocks},
    "preempt_group_swaps_the_victim_alone": {"preempt_group": preempt_group_swaps_the_victim_alone},
    "lookup_past_the_first_miss": {"get_num_new_matched_tokens": lookup_past_the_first_miss},
    "lookup_covers_the_last_token": {"get_num_new_matched_tokens": lookup_covers_the_last_token},
    "lookup_does_not_hold_the_hits": {"get_num_new_matched_tokens": lookup_does_not_hold_the_hits},
    "lookup_from_the_first_block": {"get_num_new_matched_tokens": lookup_from_the_first_block},
    "lookup_counts_every_prompt_token": {"get_num_new_matched_tokens": lookup_counts_every_prompt_token},
}

# One mutant per exercise that must also break the capstone (the capstone runs every piece).
CAPSTONE_MUTANTS = {
    "swap_out": "swap_out_one_host_reference",
    "swap_in": "swap_in_keeps_the_host_blocks",
    "preempt_group": "preempt_group_checks_the_device_pool",
    "get_num_new_matched_tokens": "lookup_does_not_hold_the_hits",
}
