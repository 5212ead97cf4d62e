"""Turn a list of scheduled sequences into one flat model input, run it, and return next-token logits.

For each sequence the new tokens are those whose K/V are not yet in the cache:
`token_ids[num_computed_tokens:]` — the whole prompt at prefill, the one newest token at decode.

Where this lives in vLLM: `vllm/v1/worker/gpu_model_runner.py` (`_prepare_inputs`, `execute_model`).
"""

import torch

from solutions.core.block_manager import slot_mapping
from solutions.model.llama import LlamaForCausalLM
from solutions.attention.paged import AttentionMetadata, KVCache, PagedAttention
from solutions.core.sequence import Sequence


def prepare_inputs(seqs: list[Sequence], block_size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """input_ids (T,), positions (T,) and the attention metadata for the new tokens of `seqs`, concatenated."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    for seq in seqs:
        start, end = seq.num_computed_tokens, seq.num_tokens
        input_ids += seq.token_ids[start:end]
        positions += range(start, end)
        slots += slot_mapping(seq.block_table, start, end, block_size)
        query_start_loc.append(query_start_loc[-1] + end - start)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.long),
        seq_lens=torch.tensor([seq.num_tokens for seq in seqs], dtype=torch.long),
        block_tables=[list(seq.block_table) for seq in seqs],
    )
    return torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), metadata


class ModelRunner:
    """Owns the model and the paged KV cache; one `execute_model` call is one forward pass."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int) -> None:
        self.model, self.block_size = model, block_size
        self.kv_cache = KVCache.allocate(model.config, num_blocks, block_size)

    def execute_model(self, seqs: list[Sequence]) -> torch.Tensor:
        """Write the new tokens' K/V and return the logits (B, V) at each sequence's last token.

        Marks those tokens computed: afterwards `num_computed_tokens == num_tokens` for every sequence.
        """
        input_ids, positions, metadata = prepare_inputs(seqs, self.block_size)
        hidden = self.model(input_ids, positions, PagedAttention(self.kv_cache, metadata))  # (T, D_model)
        last_rows = metadata.query_start_loc[1:] - 1  # (B,) row of each sequence's last new token
        for seq in seqs:
            seq.num_computed_tokens = seq.num_tokens
        return self.model.compute_logits(hidden[last_rows])  # (B, V)
