"""Plausible wrong answers to chapter 09's exercises; each must fail at least one test of its exercise.

Class exercises are mutated by subclassing the reference and overriding the method that goes wrong.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from solutions.distributed import layers
from solutions.distributed.layers import Partition, split_evenly
from solutions.distributed.parallel_state import all_reduce, tp_size
from solutions.model.config import ModelConfig

# The reference functions, taken when this module is loaded: inside a capstone's `swap_in`, `layers.partition` and
# `layers.shard_weight` are the mutant itself, and a mutant that deferred to them would only recurse.
reference_partition = layers.partition
reference_shard_weight = layers.shard_weight

# --- partition ----------------------------------------------------------------------------------------------------


def partition_splits_query_heads_evenly(config: ModelConfig, tp_size: int) -> list[Partition]:
    """Splits query heads and K/V heads each as evenly as they go, apart: SmolLM2's 9 query heads become 4 + 5, so
    rank 0's fourth query head belongs to a K/V head it does not hold."""
    return [Partition(q, kv, i, v) for q, kv, i, v in zip(
        split_evenly(config.num_attention_heads, tp_size), split_evenly(config.num_key_value_heads, tp_size),
        split_evenly(config.intermediate_size, tp_size), split_evenly(config.vocab_size, tp_size), strict=True)]


def partition_replicates_kv_heads_round_robin(config: ModelConfig, tp_size: int) -> list[Partition]:
    """Gives rank r the K/V head r % num_kv_heads when ranks outnumber K/V heads, while its query heads are the
    r-th run: with 2 K/V heads over 4 ranks, rank 1's query heads 2, 3 (of K/V head 0) get K/V head 1."""
    kv = config.num_key_value_heads
    if kv >= tp_size:
        return reference_partition(config, tp_size)
    return [Partition(p.q_heads, (r % kv, r % kv + 1), p.intermediate, p.vocab)
            for r, p in enumerate(reference_partition(config, tp_size))]


def partition_drops_the_remainder(config: ModelConfig, tp_size: int) -> list[Partition]:
    """Cuts the vocabulary and the MLP width into tp_size pieces of size total // tp_size: an odd remainder (the
    last token ids, the last hidden units) belongs to no rank."""
    def floor_ranges(total: int) -> list[tuple[int, int]]:
        size = total // tp_size
        return [(r * size, (r + 1) * size) for r in range(tp_size)]

    return [Partition(p.q_heads, p.kv_heads, i, v) for p, i, v in zip(
        reference_partition(config, tp_size), floor_ranges(config.intermediate_size), floor_ranges(config.vocab_size),
        strict=True)]


def partition_never_refuses(config: ModelConfig, tp_size: int) -> list[Partition]:
    """Replicates K/V heads with tp_size // num_kv_heads replicas without checking that it divides: 2 K/V heads
    over 3 ranks hand rank 2 a third K/V head that does not exist, and nothing is raised."""
    kv, group = config.num_key_value_heads, config.num_queries_per_kv
    if kv >= tp_size:
        return reference_partition(config, tp_size)
    replicas = max(1, tp_size // kv)
    kv_ranges = [(r // replicas, r // replicas + 1) for r in range(tp_size)]
    q_ranges = [(h * group + a, h * group + b) for h, _ in kv_ranges[::replicas]
                for a, b in split_evenly(group, replicas)]
    return [Partition(q, k, i, v) for q, k, i, v in zip(
        q_ranges, kv_ranges, split_evenly(config.intermediate_size, tp_size), split_evenly(config.vocab_size, tp_size),
        strict=False)]


# --- shard_weight -------------------------------------------------------------------------------------------------


def _cut(tensor: torch.Tensor, dim: int, span: tuple[int, int]) -> torch.Tensor:
    return tensor.narrow(dim, span[0], span[1] - span[0])


def shard_weight_o_proj_by_rows(name: str, tensor: torch.Tensor, part: Partition, head_dim: int) -> torch.Tensor:
    """Cuts o_proj like q_proj, by output rows: but o_proj's output is the hidden state every rank needs whole;
    its input (the attention heads' outputs) is what the rank holds a slice of."""
    if name.endswith("o_proj.weight"):
        return _cut(tensor, 0, (part.q_heads[0] * head_dim, part.q_heads[1] * head_dim))
    return reference_shard_weight(name, tensor, part, head_dim)


def shard_weight_kv_by_query_heads(name: str, tensor: torch.Tensor, part: Partition, head_dim: int) -> torch.Tensor:
    """Cuts k_proj and v_proj by the rank's query-head range, as if every query head had its own K/V head."""
    if name.split(".")[-2] in ("k_proj", "v_proj"):
        return _cut(tensor, 0, (part.q_heads[0] * head_dim, part.q_heads[1] * head_dim))
    return reference_shard_weight(name, tensor, part, head_dim)


def shard_weight_kv_heads_from_zero(name: str, tensor: torch.Tensor, part: Partition, head_dim: int) -> torch.Tensor:
    """Keeps as many K/V heads as the rank holds, but always the first ones: rank 1 of SmolLM2 gets K/V heads 0
    and 1 instead of 1 and 2 (the right shape, the wrong heads)."""
    if name.split(".")[-2] in ("k_proj", "v_proj"):
        return _cut(tensor, 0, (0, (part.kv_heads[1] - part.kv_heads[0]) * head_dim))
    return reference_shard_weight(name, tensor, part, head_dim)


def shard_weight_without_head_dim(name: str, tensor: torch.Tensor, part: Partition, head_dim: int) -> torch.Tensor:
    """Cuts q_proj's rows by head numbers, forgetting that each head is head_dim rows."""
    if name.split(".")[-2] == "q_proj":
        return _cut(tensor, 0, part.q_heads)
    return reference_shard_weight(name, tensor, part, head_dim)


def shard_weight_splits_row_parallel_bias(name: str, tensor: torch.Tensor, part: Partition,
                                          head_dim: int) -> torch.Tensor:
    """Cuts o_proj's and down_proj's bias like their weights' columns: but a row-parallel layer's bias belongs to
    its (whole) output, and is added once after the all-reduce."""
    if name.endswith("o_proj.bias"):
        return _cut(tensor, 0, (part.q_heads[0] * head_dim, part.q_heads[1] * head_dim))
    if name.endswith("down_proj.bias"):
        return _cut(tensor, 0, part.intermediate)
    return reference_shard_weight(name, tensor, part, head_dim)


# --- RowParallelLinear --------------------------------------------------------------------------------------------


class RowParallelLinearBiasPerRank(layers.RowParallelLinear):
    """Adds the bias before the all-reduce: every rank adds it, so the sum holds it tp_size times."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(F.linear(x, self.weight, self.bias))


class RowParallelLinearWithoutAllReduce(layers.RowParallelLinear):
    """Returns each rank's partial product as if it were the output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        return out if self.bias is None else out + self.bias


class RowParallelLinearAverages(layers.RowParallelLinear):
    """Averages the partial products over the ranks instead of summing them (as gradients are averaged in data
    parallelism)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(F.linear(x, self.weight)) / tp_size()
        return out if self.bias is None else out + self.bias


class RowParallelLinearReducesToRankZero(layers.RowParallelLinear):
    """Reduces onto rank 0 only (`dist.reduce`): rank 0 gets the sum, the others keep a partial one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.reduce(out, dst=0)
        return out if self.bias is None else out + self.bias


# --- VocabParallelEmbedding ---------------------------------------------------------------------------------------


class VocabParallelEmbeddingClampsWithoutMasking(layers.VocabParallelEmbedding):
    """Clamps every token id into this rank's range, and forgets to zero the rows of tokens it does not hold: a
    token is counted once by its rank and again, as the nearest row, by every other rank."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids.clamp(self.vocab_start, self.vocab_end - 1) - self.vocab_start
        return all_reduce(F.embedding(local, self.weight))


class VocabParallelEmbeddingWithoutOffset(layers.VocabParallelEmbedding):
    """Looks a token up at its global id in the rank's local table (no `- vocab_start`)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        rows = F.embedding(torch.where(mine, input_ids, 0), self.weight)
        return all_reduce(rows * mine[:, None].to(rows.dtype))


class VocabParallelEmbeddingWithoutAllReduce(layers.VocabParallelEmbedding):
    """Returns this rank's rows, zeros for the other tokens, without adding the other ranks' rows."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        rows = F.embedding(torch.where(mine, input_ids - self.vocab_start, 0), self.weight)
        return rows * mine[:, None].to(rows.dtype)


class VocabParallelEmbeddingEndInclusive(layers.VocabParallelEmbedding):
    """Treats the range as [start, end]: the first token of the next rank's range is claimed by this rank too, and
    read past the end of its table."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.vocab_start) & (input_ids <= self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0).clamp(max=self.weight.shape[0] - 1)
        rows = F.embedding(local, self.weight)
        return all_reduce(rows * mine[:, None].to(rows.dtype))


MUTANTS = {
    "partition_splits_query_heads_evenly": {"partition": partition_splits_query_heads_evenly},
    "partition_replicates_kv_heads_round_robin": {"partition": partition_replicates_kv_heads_round_robin},
    "partition_drops_the_remainder": {"partition": partition_drops_the_remainder},
    "partition_never_refuses": {"partition": partition_never_refuses},
    "shard_weight_o_proj_by_rows": {"shard_weight": shard_weight_o_proj_by_rows},
    "shard_weight_kv_by_query_heads": {"shard_weight": shard_weight_kv_by_query_heads},
    "shard_weight_kv_heads_from_zero": {"shard_weight": shard_weight_kv_heads_from_zero},
    "shard_weight_without_head_dim": {"shard_weight": shard_weight_without_head_dim},
    "shard_weight_splits_row_parallel_bias": {"shard_weight": shard_weight_splits_row_parallel_bias},
    "row_parallel_linear_bias_per_rank": {"RowParallelLinear": RowParallelLinearBiasPerRank},
    "row_parallel_linear_without_all_reduce": {"RowParallelLinear": RowParallelLinearWithoutAllReduce},
    "row_parallel_linear_averages": {"RowParallelLinear": RowParallelLinearAverages},
    "row_parallel_linear_reduces_to_rank_zero": {"RowParallelLinear": RowParallelLinearReducesToRankZero},
    "vocab_parallel_embedding_clamps_without_masking": {
        "VocabParallelEmbedding": VocabParallelEmbeddingClampsWithoutMasking,
    },
    "vocab_parallel_embedding_without_offset": {"VocabParallelEmbedding": VocabParallelEmbeddingWithoutOffset},
    "vocab_parallel_embedding_without_all_reduce": {"VocabParallelEmbedding": VocabParallelEmbeddingWithoutAllReduce},
    "vocab_parallel_embedding_end_inclusive": {"VocabParallelEmbedding": VocabParallelEmbeddingEndInclusive},
}

# One mutant per exercise that must also break the capstone (the capstone runs every piece).
CAPSTONE_MUTANTS = {
    "partition": "partition_splits_query_heads_evenly",
    "shard_weight": "shard_weight_kv_heads_from_zero",
    "RowParallelLinear": "row_parallel_linear_without_all_reduce",
    "VocabParallelEmbedding": "vocab_parallel_embedding_clamps_without_masking",
}
