"""Chapter 3's capstone: greedy generation for a static batch of prompts over the paged KV cache.

All prompts are prefilled in one flat forward pass, then every step decodes one token for each sequence,
again in one pass. The block manager hands out a block only when a sequence's newest token starts one.
"""

import torch

from solutions.core.block_manager import BlockManager, cdiv
from solutions.core.sched.output import SchedulerOutput
from solutions.model.llama import LlamaForCausalLM
from solutions.worker.model_runner import ModelRunner
from solutions.core.sequence import Sequence, SequenceStatus


def generate_paged(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16
) -> list[list[int]]:
    """New token ids for each prompt (greedy, exactly `max_new_tokens` each). Frees every block at the end."""
    num_blocks = sum(cdiv(len(p) + max_new_tokens, block_size) for p in prompts)  # enough for the whole batch
    block_manager = BlockManager(num_blocks, block_size)
    runner = ModelRunner(model, num_blocks, block_size)
    seqs = [Sequence(i, prompt) for i, prompt in enumerate(prompts)]
    for seq in seqs:
        block_manager.allocate(seq)
        seq.status = SequenceStatus.RUNNING
    for _ in range(max_new_tokens):
        step = SchedulerOutput(seqs, [seq.num_tokens - seq.num_computed_tokens for seq in seqs])  # all uncomputed tokens
        logits = runner.execute_model(step)  # (B, V): first a prefill of every prompt, then decodes
        for seq, token_id in zip(seqs, torch.argmax(logits, dim=-1).tolist(), strict=True):
            seq.append_token(token_id)
            block_manager.append_slot(seq)  # room for the new token's K/V, written by the next step
    for seq in seqs:
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED  # exactly max_new_tokens each
        block_manager.free(seq)
    return [seq.output_token_ids for seq in seqs]
