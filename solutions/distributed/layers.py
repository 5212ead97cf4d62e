"""Which rank holds which heads and hidden units, and the layers that join the slices.

Megatron-LM's split of a transformer layer, as vLLM does it: of two matmuls with only per-unit work between them,
the first is split by its outputs (*column parallel*: each rank computes some heads or hidden units) and the
second by its inputs (*row parallel*: each rank gets a partial sum of the full output); one all-reduce per pair
makes the sums whole:
    attention   q/k/v_proj column parallel (each rank: its heads)  →  attention on its heads  →  o_proj row parallel
    MLP         gate/up_proj column parallel (its hidden units)    →  SwiGLU                   →  down_proj row parallel
Heads are independent, and a rank's query heads read the K/V heads it computes itself, so each rank's KV cache
holds only its own heads, in the same blocks (one block table serves every rank).

Heads are dealt by K/V groups, so a query head sits with its K/V head. With more K/V heads than ranks each rank gets
a run of whole groups, as evenly as they divide (SmolLM2's 3 over 2 ranks: 1 and 2; vLLM requires an even split
and refuses such a model); with fewer, each K/V head is replicated on `tp_size / num_kv_heads` ranks that split its
query heads, as vLLM does; otherwise `tensor_parallel_size` is refused, naming the values that work. The vocabulary
is split into ranges: the embedding sums its ranks' rows, the LM head gathers its ranks' logits.

Where this lives in vLLM: `vllm/model_executor/layers/linear.py` (`ColumnParallelLinear`, `QKVParallelLinear`,
`RowParallelLinear`) and `vllm/model_executor/layers/vocab_parallel_embedding.py`.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from solutions.distributed.parallel_state import all_gather, all_reduce
from solutions.model.config import ModelConfig
from solutions.model.llama import LlamaForCausalLM


def split_evenly(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each of `parts` contiguous ranges covering range(total), sizes differing by at most 1."""
    bounds = [total * i // parts for i in range(parts + 1)]
    return list(zip(bounds, bounds[1:]))


def allowed_tensor_parallel_sizes(config: ModelConfig) -> list[int]:
    """The rank counts `partition` accepts: up to one per K/V head (whole groups, as evenly as they go), or each
    K/V head replicated on a number of ranks that divides its group of query heads."""
    kv, group = config.num_key_value_heads, config.num_queries_per_kv
    return list(range(1, kv + 1)) + [kv * r for r in range(2, group + 1) if group % r == 0]


@dataclasses.dataclass(frozen=True)
class Partition:
    """What one rank holds: [start, end) of the query heads, K/V heads, MLP hidden units and vocabulary."""

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]


def partition(config: ModelConfig, tp_size: int) -> list[Partition]:
    """Each rank's `Partition` (see the module docstring)."""
    kv, group = config.num_key_value_heads, config.num_queries_per_kv
    if kv >= tp_size:
        kv_ranges = split_evenly(kv, tp_size)
        q_ranges = [(a * group, b * group) for a, b in kv_ranges]
    else:
        if tp_size % kv or group % (tp_size // kv):
            raise ValueError(
                f"tensor_parallel_size={tp_size} cannot split {config.num_attention_heads} query heads in {kv} K/V "
                f"groups of {group}: above {kv} ranks each K/V head is replicated, so tensor_parallel_size must be "
                f"{kv} times a divisor of {group}; allowed values: {allowed_tensor_parallel_sizes(config)}"
            )
        replicas = tp_size // kv
        kv_ranges = [(r // replicas, r // replicas + 1) for r in range(tp_size)]
        q_ranges = [(h * group + a, h * group + b) for h in range(kv) for a, b in split_evenly(group, replicas)]
    return [
        Partition(q, k, i, v) for q, k, i, v in zip(
            q_ranges, kv_ranges, split_evenly(config.intermediate_size, tp_size),
            split_evenly(config.vocab_size, tp_size),
            strict=True,
        )
    ]


class RowParallelLinear(nn.Linear):
    """A linear layer holding a slice of its input features: each rank's product is a partial sum of the full
    output, and an all-reduce adds them. The bias is added once, after the sum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """The embedding rows of the token ids in [start, end); a token outside the range embeds as zeros here, and
    the all-reduce takes each token's row from the rank that holds it."""

    def __init__(self, vocab_range: tuple[int, int], embedding_dim: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__(vocab_range[1] - vocab_range[0], embedding_dim, dtype=dtype, device=device)
        self.vocab_start, self.vocab_end = vocab_range

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # (T,)
        rows = F.embedding(torch.where(mine, input_ids - self.vocab_start, 0), self.weight)  # (T, D)
        return all_reduce(rows * mine[:, None].to(rows.dtype))


class ParallelLMHead(nn.Linear):
    """The LM head's rows for the vocabulary range of this rank; the logits are gathered whole on every rank."""

    def __init__(self, vocab_ranges: list[tuple[int, int]], rank: int, hidden_size: int) -> None:
        start, end = vocab_ranges[rank]
        super().__init__(hidden_size, end - start, bias=False)
        self.sizes = [b - a for a, b in vocab_ranges]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather(F.linear(hidden, self.weight), self.sizes)  # (T, V)


def local_config(config: ModelConfig, part: Partition) -> ModelConfig:
    """The shape one rank's modules are built with: its heads and hidden units (the vocabulary stays whole: the
    parallel embedding and LM head hold their own ranges)."""
    return dataclasses.replace(
        config,
        num_attention_heads=part.q_heads[1] - part.q_heads[0],
        num_key_value_heads=part.kv_heads[1] - part.kv_heads[0],
        intermediate_size=part.intermediate[1] - part.intermediate[0],
    )


def shard_weight(name: str, tensor: torch.Tensor, part: Partition, head_dim: int) -> torch.Tensor:
    """The part of the full model's parameter `name` (e.g. "model.layers.0.self_attn.q_proj.weight") that the rank
    holding `part` keeps: column-parallel layers (q/k/v_proj by heads, gate/up_proj by hidden units) keep output rows
    of the (out_features, in_features) weight and those bias entries; row-parallel layers (o_proj, down_proj) keep
    input columns and a whole bias (added once, after the all-reduce); the embedding and LM head keep their vocabulary
    range's rows; the norms stay whole."""
    q = (part.q_heads[0] * head_dim, part.q_heads[1] * head_dim)
    kv = (part.kv_heads[0] * head_dim, part.kv_heads[1] * head_dim)
    column = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": part.intermediate, "up_proj": part.intermediate}
    keep = {(module, parameter): (0, rows) for module, rows in column.items() for parameter in ("weight", "bias")}
    keep |= {  # (module, parameter) -> (dimension, [start, end))
        ("o_proj", "weight"): (1, q), ("down_proj", "weight"): (1, part.intermediate),
        ("embed_tokens", "weight"): (0, part.vocab), ("lm_head", "weight"): (0, part.vocab),
    }
    if (rule := keep.get(tuple(name.split(".")[-2:]))) is None:
        return tensor
    dim, (start, end) = rule
    return tensor.narrow(dim, start, end - start)


def shard_model(full: LlamaForCausalLM, rank: int, tp_size: int) -> LlamaForCausalLM:
    """Rank `rank`'s slice of `full`: the same module tree, built for its heads and hidden units, with o_proj
    and down_proj row parallel, and the embedding and LM head vocabulary parallel."""
    config = full.config
    parts = partition(config, tp_size)
    part = parts[rank]
    state = {  # a copy of each slice, so that the full model can be freed
        name: shard_weight(name, tensor, part, config.head_dim).clone(memory_format=torch.contiguous_format)
        for name, tensor in full.state_dict().items()
    }

    local = local_config(config, part)
    with torch.device("meta"):
        model = LlamaForCausalLM(local)
        model.model.embed_tokens = VocabParallelEmbedding(part.vocab, config.hidden_size)
        model.lm_head = ParallelLMHead([p.vocab for p in parts], rank, config.hidden_size)
        for layer in model.model.layers:
            layer.self_attn.o_proj = RowParallelLinear(local.num_attention_heads * config.head_dim, config.hidden_size,
                                                       bias=config.o_proj_bias)
            layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, config.hidden_size, bias=config.mlp_bias)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=not config.tie_word_embeddings, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.inv_freq = full.model.rotary_emb.inv_freq
    return model.eval()
