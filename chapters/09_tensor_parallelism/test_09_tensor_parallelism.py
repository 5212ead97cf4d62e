"""Grading tests for chapter 09 — tensor parallelism.

Each test grades one exercise (`@pytest.mark.exercise`). The oracles owe nothing to the code under test: head
ranges written out by hand and the rules every partition must keep (each query head once, beside its K/V head);
slices cut by reshaping a weight into its heads; the whole layer (`F.linear`, `F.embedding` on the unsplit
weight) for what the ranks compute together, on a real gloo group of 2 or 3 processes (`grading/ranks.py`);
and, for the capstone, Hugging Face's greedy tokens for SmolLM2 split over 2 ranks.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from grading import exercising, expect_close, expect_equal, expect_raises
from grading.capstone import CAPSTONE_PROMPTS, generate_batch, smollm2_greedy, swap_in
from grading.ranks import run_on_ranks
from solutions import SamplingParams
from solutions.distributed import layers
from solutions.distributed.layers import Partition
from solutions.engine.arg_utils import EngineArgs
from solutions.engine.llm_engine import LLMEngine
from solutions.model.config import ModelConfig

REFERENCE = {
    "partition": layers.partition,
    "shard_weight": layers.shard_weight,
    "RowParallelLinear": layers.RowParallelLinear,
    "VocabParallelEmbedding": layers.VocabParallelEmbedding,
}

pytestmark = pytest.mark.timeout(120)


def config(q_heads: int, kv_heads: int, *, intermediate: int = 128, vocab: int = 256, head_dim: int = 8,
           hidden: int = 32) -> ModelConfig:
    """A Llama config with these head counts (only the shapes matter here)."""
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=2, num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, qkv_bias=False, o_proj_bias=False,
        mlp_bias=False, tie_word_embeddings=False, max_position_embeddings=512, eos_token_id=None,
    )


SMOLLM2 = config(9, 3, intermediate=1536, vocab=49152, head_dim=64, hidden=576)

# --- partition ----------------------------------------------------------------------------------------------------


def partitions(impl, cfg: ModelConfig, tp_size: int, inputs: str) -> list[Partition]:
    with exercising("partition", inputs):
        return [dataclasses.astuple(p) for p in impl.partition(cfg, tp_size)]


def name(cfg: ModelConfig, tp_size: int) -> str:
    return (f"partition({cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} K/V heads, intermediate "
            f"{cfg.intermediate_size}, vocab {cfg.vocab_size}; tp_size={tp_size})")


@pytest.mark.exercise("partition")
def test_partition_deals_smollm2s_three_kv_groups_over_two_ranks(impl):
    inputs = name(SMOLLM2, 2) + " — SmolLM2's shape: 3 query heads read each K/V head"
    want = [((0, 3), (0, 1), (0, 768), (0, 24576)), ((3, 9), (1, 3), (768, 1536), (24576, 49152))]
    expect_equal(partitions(impl, SMOLLM2, 2, inputs), want, inputs=f"{inputs}; each rank's (q_heads, kv_heads, "
                 "intermediate, vocab) ranges: whole K/V groups, split_evenly(3, 2) = 1 group and 2, so 3 and 6 query "
                 "heads (splitting the 9 query heads 4 + 5 would part a query head from its K/V head)")


@pytest.mark.exercise("partition")
def test_partition_splits_evenly_when_the_groups_divide(impl):
    cases = [
        (config(4, 2), 2, [((0, 2), (0, 1), (0, 64), (0, 128)), ((2, 4), (1, 2), (64, 128), (128, 256))]),
        (config(32, 8, intermediate=14336, vocab=128256, head_dim=128, hidden=4096), 4,  # Llama-3-8B over 4
         [((0, 8), (0, 2), (0, 3584), (0, 32064)), ((8, 16), (2, 4), (3584, 7168), (32064, 64128)),
          ((16, 24), (4, 6), (7168, 10752), (64128, 96192)), ((24, 32), (6, 8), (10752, 14336), (96192, 128256))]),
        (config(4, 4, intermediate=100, vocab=7), 2,
         [((0, 2), (0, 2), (0, 50), (0, 3)), ((2, 4), (2, 4), (50, 100), (3, 7))]),
        (config(6, 3), 1, [((0, 6), (0, 3), (0, 128), (0, 256))]),
    ]
    for cfg, tp_size, want in cases:
        inputs = name(cfg, tp_size)
        expect_equal(partitions(impl, cfg, tp_size, inputs), want, inputs=f"{inputs}; each rank's (q_heads, kv_heads, "
                     "intermediate, vocab) ranges (an odd vocabulary or width: split_evenly's sizes)")


@pytest.mark.exercise("partition")
def test_partition_replicates_a_kv_head_when_ranks_outnumber_kv_heads(impl):
    cases = [
        (config(4, 1), 2, [((0, 2), (0, 1)), ((2, 4), (0, 1))]),
        (config(8, 2), 4, [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]),
        (config(12, 2), 4, [((0, 3), (0, 1)), ((3, 6), (0, 1)), ((6, 9), (1, 2)), ((9, 12), (1, 2))]),
    ]
    for cfg, tp_size, want in cases:
        inputs = name(cfg, tp_size)
        got = [(q, kv) for q, kv, _, _ in partitions(impl, cfg, tp_size, inputs)]
        expect_equal(got, want, inputs=f"{inputs}; each rank's (q_heads, kv_heads): each K/V head on "
                     f"{tp_size // cfg.num_key_value_heads} ranks, its query heads split among them")


def broken_rules(parts: list[tuple], cfg: ModelConfig, tp_size: int) -> list[str]:
    """What a partition gets wrong, by rules alone (no expected answer): [] when it is a valid split."""
    if len(parts) != tp_size:
        return [f"{len(parts)} partitions for {tp_size} ranks"]
    group, wrong = cfg.num_queries_per_kv, []
    for field, total in ((0, cfg.num_attention_heads), (2, cfg.intermediate_size), (3, cfg.vocab_size)):
        ranges = [p[field] for p in parts]
        if [a for a, _ in ranges] + [total] != [0] + [b for _, b in ranges]:
            kind = ("q_heads", "", "intermediate", "vocab")[field]
            wrong.append(f"the {kind} ranges {ranges} do not cover 0..{total} in order, each once")
    for rank, (q, kv, _, _) in enumerate(parts):
        if not (q[0] < q[1] and kv[0] < kv[1]):
            wrong.append(f"rank {rank} holds no query or no K/V head: {q}, {kv}")
        strays = [h for h in range(*q) if not kv[0] <= h // group < kv[1]]
        if strays:
            wrong.append(f"rank {rank}'s query heads {strays} read K/V heads {sorted({h // group for h in strays})}, "
                         f"which it does not hold ({kv})")
    return wrong


@pytest.mark.exercise("partition")
def test_partition_keeps_every_query_head_with_its_kv_head_over_many_shapes(impl):
    for q_heads, kv_heads in ((9, 3), (4, 2), (6, 2), (12, 4), (16, 8), (8, 1), (10, 5), (14, 7)):
        for tp_size in (1, 2, 3, 4):
            if kv_heads < tp_size and (tp_size % kv_heads or (q_heads // kv_heads) % (tp_size // kv_heads)):
                continue  # no valid split: the next test
            cfg = config(q_heads, kv_heads, intermediate=97, vocab=101)
            inputs = name(cfg, tp_size)
            wrong = broken_rules(partitions(impl, cfg, tp_size, inputs), cfg, tp_size)
            expect_equal(wrong, [], inputs=f"{inputs}; the rules a split keeps")


@pytest.mark.exercise("partition")
def test_partition_refuses_a_split_that_parts_heads(impl):
    for cfg, tp_size in ((config(4, 2), 3), (config(4, 1), 8), (config(6, 2), 4)):
        inputs = f"{name(cfg, tp_size)}: fewer K/V heads than ranks, and the ranks do not divide them evenly"
        expect_raises(ValueError, lambda cfg=cfg, tp_size=tp_size: impl.partition(cfg, tp_size), inputs=inputs)


# --- shard_weight -------------------------------------------------------------------------------------------------


def full_state(cfg: ModelConfig, *, bias: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """One decoder layer's parameters, plus the embedding, final norm and LM head, named as in the model."""
    g = torch.Generator().manual_seed(seed)
    d, hq, hkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd, ffn = cfg.head_dim, cfg.intermediate_size
    shapes = {
        "model.embed_tokens.weight": (cfg.vocab_size, d),
        "model.layers.0.input_layernorm.weight": (d,),
        "model.layers.0.self_attn.q_proj.weight": (hq * hd, d),
        "model.layers.0.self_attn.k_proj.weight": (hkv * hd, d),
        "model.layers.0.self_attn.v_proj.weight": (hkv * hd, d),
        "model.layers.0.self_attn.o_proj.weight": (d, hq * hd),
        "model.layers.0.post_attention_layernorm.weight": (d,),
        "model.layers.0.mlp.gate_proj.weight": (ffn, d),
        "model.layers.0.mlp.up_proj.weight": (ffn, d),
        "model.layers.0.mlp.down_proj.weight": (d, ffn),
        "model.norm.weight": (d,),
        "lm_head.weight": (cfg.vocab_size, d),
    }
    if bias:
        shapes |= {
            "model.layers.0.self_attn.q_proj.bias": (hq * hd,), "model.layers.0.self_attn.k_proj.bias": (hkv * hd,),
            "model.layers.0.self_attn.v_proj.bias": (hkv * hd,), "model.layers.0.self_attn.o_proj.bias": (d,),
            "model.layers.0.mlp.gate_proj.bias": (ffn,), "model.layers.0.mlp.up_proj.bias": (ffn,),
            "model.layers.0.mlp.down_proj.bias": (d,),
        }
    return {k: torch.randn(shape, generator=g) for k, shape in shapes.items()}


def heads(w: torch.Tensor, head_dim: int, first: int, last: int, *, dim: int = 0) -> torch.Tensor:
    """Heads first..last-1 of a weight whose `dim` runs over heads of `head_dim`, cut by reshaping into heads."""
    if dim == 1:
        return heads(w.T, head_dim, first, last).T
    return w.reshape(-1, head_dim, *w.shape[1:])[first:last].reshape(-1, *w.shape[1:])


def oracle_slice(key: str, w: torch.Tensor, part: Partition, head_dim: int) -> torch.Tensor:
    """What a rank keeps, written from the layer's role: heads for attention, units for the MLP, rows of the
    vocabulary; whole for norms and a row-parallel layer's bias."""
    module, kind = key.split(".")[-2:]
    (q0, q1), (k0, k1), (i0, i1), (v0, v1) = part.q_heads, part.kv_heads, part.intermediate, part.vocab
    if module == "q_proj":
        return heads(w, head_dim, q0, q1)
    if module in ("k_proj", "v_proj"):
        return heads(w, head_dim, k0, k1)
    if module == "o_proj" and kind == "weight":
        return heads(w, head_dim, q0, q1, dim=1)
    if module in ("gate_proj", "up_proj"):
        return w[i0:i1]
    if module == "down_proj" and kind == "weight":
        return w[:, i0:i1]
    if module in ("embed_tokens", "lm_head"):
        return w[v0:v1]
    return w


def expect_slices(impl, cfg: ModelConfig, tp_size: int, state: dict[str, torch.Tensor], inputs: str) -> None:
    for rank, part in enumerate(layers.partition(cfg, tp_size)):
        for key, w in state.items():
            where = f"{inputs}; rank {rank} of {tp_size} ({part}); shard_weight({key!r}, {tuple(w.shape)})"
            with exercising("shard_weight", where):
                got = impl.shard_weight(key, w, part, cfg.head_dim)
            expect_close(got, oracle_slice(key, w, part, cfg.head_dim), inputs=where, atol=0, rtol=0)


@pytest.mark.exercise("shard_weight")
def test_shard_weight_cuts_every_parameter_of_smollm2s_shape(impl):
    expect_slices(impl, SMOLLM2, 2, full_state(SMOLLM2),
                  "SmolLM2's shape (9 query heads, 3 K/V, head_dim 64, intermediate 1536, vocab 49152)")


@pytest.mark.exercise("shard_weight")
def test_shard_weight_cuts_biases_with_their_rows_and_keeps_a_row_parallel_bias_whole(impl):
    cfg = config(4, 2)
    expect_slices(impl, cfg, 2, full_state(cfg, bias=True),
                  "4 query heads, 2 K/V, head_dim 8, every projection with a bias (o_proj's and down_proj's stay "
                  "whole: added once, after the all-reduce)")


@pytest.mark.exercise("shard_weight")
def test_shard_weight_replicates_a_kv_head_over_ranks(impl):
    cfg = config(8, 2, intermediate=30, vocab=50)
    expect_slices(impl, cfg, 4, full_state(cfg, bias=True), "8 query heads, 2 K/V heads, 4 ranks (each K/V head on 2)")


@pytest.mark.exercise("shard_weight")
def test_shard_weight_column_and_row_slices_recompose_the_whole_layer(impl):
    cfg = config(6, 3, intermediate=48)
    state = full_state(cfg, bias=True)
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    parts = layers.partition(cfg, 2)
    for proj, row in (("self_attn.q_proj", "self_attn.o_proj"), ("mlp.up_proj", "mlp.down_proj")):
        w_col, b_col = state[f"model.layers.0.{proj}.weight"], state[f"model.layers.0.{proj}.bias"]
        w_row, b_row = state[f"model.layers.0.{row}.weight"], state[f"model.layers.0.{row}.bias"]
        inputs = f"6 query heads, 3 K/V, 2 ranks ({parts}): {proj} then {row} on x (5, {cfg.hidden_size})"
        hidden, out = [], torch.zeros(5, cfg.hidden_size)
        with exercising("shard_weight", inputs):
            for part in parts:
                mine = F.linear(x, impl.shard_weight(f"model.layers.0.{proj}.weight", w_col, part, cfg.head_dim),
                                impl.shard_weight(f"model.layers.0.{proj}.bias", b_col, part, cfg.head_dim))
                hidden.append(mine)
                out += F.linear(mine, impl.shard_weight(f"model.layers.0.{row}.weight", w_row, part, cfg.head_dim))
        expect_close(torch.cat(hidden, dim=-1), F.linear(x, w_col, b_col), inputs=f"{inputs}; the column-parallel "
                     "outputs of the ranks side by side, against the whole layer's", atol=1e-5)
        expect_close(out + b_row, F.linear(F.linear(x, w_col, b_col), w_row, b_row), inputs=f"{inputs}; the sum of the "
                     "ranks' row-parallel outputs plus the bias once, against the whole pair of layers", atol=1e-4)


# --- RowParallelLinear --------------------------------------------------------------------------------------------


def row_parallel_case(rank: int, cls: type, in_features: int, out_features: int, bias: bool, rows: int, world: int):
    """Rank `rank` of a row-parallel split of one whole linear layer: this rank's output, and the whole layer's."""
    g = torch.Generator().manual_seed(7)
    whole = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        whole.weight.copy_(torch.randn(out_features, in_features, generator=g))
        if bias:
            whole.bias.copy_(torch.randn(out_features, generator=g))
    x = torch.randn(rows, in_features, generator=g)
    start, end = layers.split_evenly(in_features, world)[rank]
    mine = cls(end - start, out_features, bias=bias)
    with torch.no_grad():
        mine.weight.copy_(whole.weight[:, start:end])
        if bias:
            mine.bias.copy_(whole.bias)
        return mine(x[:, start:end].clone()), whole(x)


def expect_row_parallel(impl, in_features: int, out_features: int, bias: bool, rows: int, world: int) -> None:
    inputs = (f"RowParallelLinear on {world} ranks: a whole Linear({in_features}, {out_features}, bias={bias}) split "
              f"by input columns {layers.split_evenly(in_features, world)}, each rank given its columns of x "
              f"({rows}, {in_features}) and the whole bias")
    results = run_on_ranks(row_parallel_case, world, impl.RowParallelLinear, in_features, out_features, bias, rows,
                           world)
    for rank, (got, want) in enumerate(results):
        expect_close(got, want, inputs=f"{inputs}; rank {rank}'s output against the whole layer's (every rank gets "
                     "the full sum)", atol=1e-4)


@pytest.mark.exercise("RowParallelLinear")
def test_row_parallel_linear_sums_the_ranks_partial_products(impl):
    expect_row_parallel(impl, 12, 5, False, 3, 2)


@pytest.mark.exercise("RowParallelLinear")
def test_row_parallel_linear_adds_its_bias_once(impl):
    expect_row_parallel(impl, 12, 5, True, 4, 2)


@pytest.mark.exercise("RowParallelLinear")
def test_row_parallel_linear_on_three_ranks_and_an_uneven_split(impl):
    expect_row_parallel(impl, 7, 6, True, 2, 3)


# --- VocabParallelEmbedding ---------------------------------------------------------------------------------------


def embedding_case(rank: int, cls: type, vocab: int, dim: int, ids: list[int], world: int):
    """Rank `rank`'s rows of one whole embedding table: this rank's output for `ids`, and the whole table's."""
    table = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(3))
    vocab_range = layers.split_evenly(vocab, world)[rank]
    mine = cls(vocab_range, dim)
    with torch.no_grad():
        mine.weight.copy_(table[vocab_range[0]:vocab_range[1]])
        return mine(torch.tensor(ids)), F.embedding(torch.tensor(ids), table)


def expect_embedding(impl, vocab: int, dim: int, ids: list[int], world: int, why: str) -> None:
    inputs = (f"VocabParallelEmbedding on {world} ranks: a ({vocab}, {dim}) table split by rows "
              f"{layers.split_evenly(vocab, world)}; token ids {ids} ({why})")
    results = run_on_ranks(embedding_case, world, impl.VocabParallelEmbedding, vocab, dim, ids, world)
    for rank, (got, want) in enumerate(results):
        expect_close(got, want, inputs=f"{inputs}; rank {rank}'s output against the whole table's rows", atol=1e-6)


@pytest.mark.exercise("VocabParallelEmbedding")
def test_vocab_parallel_embedding_takes_each_tokens_row_from_the_rank_that_holds_it(impl):
    expect_embedding(impl, 10, 4, [0, 4, 5, 9, 3, 7, 7], 2, "both ends of both ranges, and a repeat")


@pytest.mark.exercise("VocabParallelEmbedding")
def test_vocab_parallel_embedding_when_one_rank_holds_every_token(impl):
    expect_embedding(impl, 10, 4, [6, 8, 9], 2, "all in rank 1's range: rank 0 contributes zeros")
    expect_embedding(impl, 10, 4, [1], 2, "one token, in rank 0's range")


@pytest.mark.exercise("VocabParallelEmbedding")
def test_vocab_parallel_embedding_on_three_ranks_and_an_uneven_split(impl):
    expect_embedding(impl, 11, 3, [0, 2, 3, 6, 7, 10, 5], 3, "every range's ends")


# --- capstone: your partition, slices and layers, SmolLM2 on 2 ranks ------------------------------------------------

CAPSTONE_PROMPT_IDS = [0, 1, 2, 3, 5]
CAPSTONE_TOKENS = 16
CAPSTONE_ENGINE = dict(block_size=16, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                       long_prefill_token_threshold=256)


@pytest.mark.exercise("capstone")
@pytest.mark.timeout(300)  # a real model on 2 ranks: about half a minute on an idle 2-core machine
def test_capstone_your_layers_on_two_ranks_give_hugging_faces_tokens_on_smollm2(impl):
    prompts = [CAPSTONE_PROMPTS[i] for i in CAPSTONE_PROMPT_IDS]
    inputs = (f"SmolLM2-135M (9 query heads, 3 K/V) at tensor_parallel_size=2, workers forked so they run your code; "
              f"CAPSTONE_PROMPTS{CAPSTONE_PROMPT_IDS} greedy, {CAPSTONE_TOKENS} tokens, one batch")
    with swap_in(impl, REFERENCE):  # your partition, slices and layers, on every rank
        engine = LLMEngine.from_engine_args(EngineArgs(
            model="smollm2-135m", tensor_parallel_size=2, worker_multiproc_method="fork", **CAPSTONE_ENGINE,
        ))
        try:
            runner = engine.engine_core.engine_core.model_executor.model_runner  # rank 0's
            kv_heads = runner.kv_cache.key_caches[0].shape[2]  # (blocks, block_size, Hkv, D)
            greedy = SamplingParams(temperature=0.0, max_tokens=CAPSTONE_TOKENS, ignore_eos=True)
            outputs = generate_batch(engine, [(prompt, greedy) for prompt in prompts])
        finally:
            engine.shutdown()  # its workers: one tensor-parallel engine per process
    expect_equal(kv_heads, 1, inputs=f"{inputs}; K/V heads in rank 0's KV cache (its one K/V group)")
    for i, output in zip(CAPSTONE_PROMPT_IDS, outputs, strict=True):
        expect_equal(output.outputs[0].token_ids, smollm2_greedy(i, CAPSTONE_TOKENS),
                     inputs=f"{inputs}; the tokens of CAPSTONE_PROMPTS[{i}] (oracle: Hugging Face greedy, one device)")
