"""Chapter 3's generation: greedy decoding for a static batch of prompts over the paged KV cache.

All prompts are prefilled in one flat forward pass, then every step decodes one token for each sequence,
again in one pass. The block manager hands out a block only when a sequence's newest token starts one.

Each step is built from chapter 3's pieces, in the open: `prepare_inputs` turns the step into a flat batch and
its slot mapping, and the `PagedAttention` backend, in every layer, stores the new K/V with `write_to_kv_cache`
and attends with `paged_attention` (one sequence at a time, through `gather_kv`). Chapter 5's engine runs the
same step inside `ModelRunner.execute_model`, with a backend that batches the decodes.
"""

import torch

from solutions.attention.paged import KVCache, PagedAttention
from solutions.core.block_manager import BlockManager
from solutions.core.sched.output import SchedulerOutput
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.model.llama import LlamaForCausalLM
from solutions.utils.math_utils import cdiv
from solutions.worker.model_runner import prepare_inputs


def generate_paged(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16
) -> list[list[int]]:
    """New token ids for each prompt (greedy, exactly `max_new_tokens` each). Frees every block at the end."""
    num_blocks = sum(cdiv(len(p) + max_new_tokens, block_size) for p in prompts)  # enough for the whole batch
    block_manager = BlockManager(num_blocks, block_size)
    kv_cache = KVCache.allocate(model.config, num_blocks, block_size)  # every layer's (num_blocks, B, Hkv, D) pools
    seqs = [Sequence(i, prompt) for i, prompt in enumerate(prompts)]  # Sequence copies the prompt
    for seq in seqs:
        block_manager.allocate(seq)
        seq.status = SequenceStatus.RUNNING
    for _ in range(max_new_tokens):
        num_new = [seq.num_tokens - seq.num_computed_tokens for seq in seqs]  # the prompts, then 1 each
        input_ids, positions, metadata = prepare_inputs(SchedulerOutput(seqs, num_new), block_size)  # (T,), (T,)
        hidden = model(input_ids, positions, PagedAttention(kv_cache, metadata))  # (T, D_model)
        logits = model.compute_logits(hidden[metadata.query_start_loc[1:] - 1])  # (B, V) at each last new token
        for seq, n, token_id in zip(seqs, num_new, torch.argmax(logits, dim=-1).tolist(), strict=True):
            seq.num_computed_tokens += n  # their K/V are in the cache now
            seq.append_token(token_id)
            block_manager.append_slot(seq)  # room for the new token's K/V, written by the next step
    for seq in seqs:
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED  # exactly max_new_tokens each
        block_manager.free(seq)
    return [seq.output_token_ids for seq in seqs]
