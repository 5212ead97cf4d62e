"""Orca inside our own engine: admit a request only with its whole reserved KV space, taken at admission.

The vLLM paper (§6.1) measures vLLM against Orca, whose KV cache is one contiguous slab per request reserved at
admission (`contiguous_allocator.py`). To compare the two ideas rather than two code bases, this manager gives the
paged engine Orca's memory behaviour and changes nothing else:

    first allocate_slots of a sequence   take cdiv(reserved_length, block_size) blocks at once, or return None
                                         (nothing changed: the request waits at the head of the queue)
    every later allocate_slots           already covered: no new block, so no preemption, ever

`reserved_length` is `max_model_len` (Max), the prompt plus the output length rounded up to a power of two (Pow2),
or the prompt plus the output length (Oracle); the output length is the request's `max_tokens` (the benchmark
sends `ignore_eos`, as the paper's oracle is told the length). A request that stops early keeps its reservation.

It reproduces reservation and internal fragmentation, the memory that limits Orca's batch size, but not external
fragmentation: the reserved blocks need not be adjacent, so the comparison favours Orca slightly. Orca reserves
per sequence, so n > 1 is refused (by the processor), and a sequence without a reservation (beam search's) stops
at its first allocation with a RuntimeError. vLLM has no such mode; its paper's Orca is a separate implementation.
"""

from solutions.baselines.contiguous_allocator import ReservationPolicy, reserved_length
from solutions.core.block_pool import KVCacheBlock
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sequence import Sequence
from solutions.utils.math_utils import cdiv

# `kv_reservation=` names for the engine and the server (the paper's Orca (Max) / (Pow2) / (Oracle)).
KV_RESERVATIONS: dict[str, ReservationPolicy] = {
    "max": ReservationPolicy.MAX_MODEL_LEN, "pow2": ReservationPolicy.POW2, "oracle": ReservationPolicy.ORACLE,
}


def reservation_policy(kv_reservation: str) -> ReservationPolicy:
    """The policy named by `kv_reservation` ("max", "pow2", "oracle"); ValueError naming the field otherwise."""
    if kv_reservation not in KV_RESERVATIONS:
        raise ValueError(f"kv_reservation must be one of {tuple(KV_RESERVATIONS)} or None, got {kv_reservation!r}")
    return KV_RESERVATIONS[kv_reservation]


class ReservingKVCacheManager(KVCacheManager):
    """A `KVCacheManager` that allocates a sequence's whole reservation the first time it is given blocks.

    Invariants: a sequence holding blocks holds at least `cdiv(reserved_length, block_size)` of them, which
    cover every token it can ever have, so only its first `allocate_slots` ever takes blocks, sized from the
    sequence's `max_tokens`; `free` forgets the reservation (a reserving engine never preempts, so a freed sequence
    is a finished one).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *, kv_reservation: str,
        max_model_len: int,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        if cdiv(max_model_len, block_size) > num_blocks:
            raise ValueError(
                f"num_kv_blocks={num_blocks} cannot hold one reservation of up to max_model_len={max_model_len} "
                f"tokens ({cdiv(max_model_len, block_size)} blocks of {block_size}); raise num_kv_blocks"
            )
        self.policy = reservation_policy(kv_reservation)
        self.max_model_len = max_model_len
        self._reserved_tokens: dict[int, int] = {}  # seq_id -> tokens reserved for it at admission

    def reserved_tokens(self, seq: Sequence) -> int:
        """Tokens `seq` reserves when admitted: the policy's guess for a request that generates at most its
        `max_tokens` (RuntimeError for a sequence without sampling parameters, such as beam search's)."""
        if seq.seq_id not in self._reserved_tokens:
            if seq.sampling_params is None:
                raise RuntimeError(
                    f"sequence {seq.seq_id} has no sampling parameters to size its reservation from (under "
                    "kv_reservation the engine serves add_request only; beam search forks and is not supported)"
                )
            output_len = min(seq.sampling_params.max_tokens, self.max_model_len - seq.num_prompt_tokens)
            reserved = reserved_length(seq.num_prompt_tokens, output_len, self.max_model_len, self.policy)
            self._reserved_tokens[seq.seq_id] = reserved
        return self._reserved_tokens[seq.seq_id]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        raise RuntimeError(f"sequence {parent.seq_id} cannot be forked under kv_reservation: "
                           "its blocks are reserved for it alone")

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[tuple[int, int]] | None:
        """The first call takes the whole reservation (prefix hits count towards it) or returns None, changing
        nothing; later calls find every slot already there and take no block."""
        if seq.block_table:
            return super().allocate_slots(seq, num_new_tokens, new_computed_blocks)
        new_computed_blocks = new_computed_blocks or []
        num_reserved_blocks = cdiv(self.reserved_tokens(seq), self.block_size)
        num_revived = sum(block.ref_cnt == 0 for block in new_computed_blocks)  # hits that leave the free queue
        if num_reserved_blocks - len(new_computed_blocks) > self.num_free_blocks - num_revived:
            return None
        copies = super().allocate_slots(seq, num_new_tokens, new_computed_blocks)  # the blocks this step fills
        assert copies is not None, f"sequence {seq.seq_id}: the reservation fit, but its first blocks did not"
        num_rest = num_reserved_blocks - len(seq.block_table)  # reserved for tokens not computed yet
        seq.block_table.extend(block.block_id for block in self.block_pool.get_new_blocks(num_rest))
        return copies

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self._reserved_tokens.pop(seq.seq_id, None)
