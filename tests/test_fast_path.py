"""The CPU's fast path (`attention_backend="inductor"`): decode attention that reads the paged cache in place,
and the forward pass compiled once for every step — the same tokens as the reference engine and as Hugging Face,
under preemption, chunked prefill and prefix caching, with no compile after start-up."""

import functools
import platform

import pytest
import torch
import torch._dynamo

from grading.parity import assert_greedy_close, hf_greedy, hf_oracle
from grading.tiny_models import prompts_with_a_shared_head, tiny_checkpoint
from solutions import LLM, SamplingParams
from solutions.attention.cpu_kernels import c_paged_decode_attention
from solutions.attention.inductor_backend import compiled_paged_decode_attention, torch_paged_decode_attention
from solutions.attention.torch_backend import batched_decode_attention
from solutions.model.loader import resolve_model

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Every scheduling path in one engine: preemption (KV for a few sequences), prompts chunked beside decodes,
# prefix-cache hits (a shared head), and steps of one token as the last requests finish.
HARD = dict(block_size=8, num_kv_blocks=60, max_num_batched_tokens=32, long_prefill_token_threshold=16, max_num_seqs=8,
            max_model_len=256)


def core(llm: LLM):
    """The engine core behind `llm`, through its in-process client: its scheduler (and KV cache manager), its
    model executor."""
    return llm.llm_engine.engine_core


def prompts_with_a_head(count: int, vocab_size: int, seed: int) -> list[list[int]]:
    return prompts_with_a_shared_head(count, vocab_size, seed, head_len=24, max_own=60, every=3)


# --- the in-place decode attention --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_seqs, max_blocks, block_size, num_kv_heads, group",
    [(5, 4, 4, 2, 3), (1, 1, 4, 2, 3), (1, 6, 8, 1, 4), (7, 1, 16, 3, 3), (3, 9, 2, 4, 1), (4, 40, 1, 3, 3),
     (3, 3, 128, 3, 3)],
    ids=["batch", "one-seq-one-block", "one-seq-mqa", "one-block-each", "mha", "block-size-1", "block-size-128"],
)
def test_in_place_decode_attention_equals_the_gather_then_sdpa(num_seqs, max_blocks, block_size, num_kv_heads, group):
    g = torch.Generator().manual_seed(num_seqs * 100 + max_blocks)
    num_blocks, D = num_seqs * max_blocks + 3, 16
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, D, generator=g)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, D, generator=g)
    block_tables = torch.randperm(num_blocks, generator=g)[: num_seqs * max_blocks].view(num_seqs, max_blocks)
    seq_lens = torch.randint(1, max_blocks * block_size + 1, (num_seqs,), generator=g)
    q = torch.randn(num_seqs, num_kv_heads * group, D, generator=g)
    expected = batched_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, D**-0.5)
    for attend in (torch_paged_decode_attention, compiled_paged_decode_attention, c_paged_decode_attention):
        got = attend(q, key_cache, value_cache, block_tables, seq_lens, D**-0.5)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# The C kernel built for this CPU, and as it is built for CPUs without AVX512-BF16 (its bf16 scores then multiply
# widened fp32 values, where vdpbf16ps takes bf16 pairs) and without AVX-512 at all (GCC's vectors on AVX2).
INSTRUCTION_SETS = {"native": (), "no-avx512bf16": ("-mno-avx512bf16",), "no-avx512": ("-mno-avx512f",)}


def verify_reference(q: torch.Tensor, key_cache, value_cache, block_tables, seq_lens, scale: float) -> torch.Tensor:
    """Q queries per sequence, q (B, Q, Hq, D), token r seeing seq_lens - (Q - 1 - r) positions: decodes, one row
    of Q at a time."""
    num_queries = q.shape[1]
    rows = [batched_decode_attention(q[:, r], key_cache, value_cache, block_tables, seq_lens - (num_queries - 1 - r),
                                     scale) for r in range(num_queries)]
    return torch.stack(rows, dim=1)


@pytest.mark.parametrize("instruction_set", INSTRUCTION_SETS, ids=list(INSTRUCTION_SETS))
def test_c_decode_kernel_at_smollm2s_shape_over_long_contexts(instruction_set, monkeypatch):
    """The C kernel (`solutions/attention/cpu_kernels.py`) at SmolLM2's heads (9 query, 3 K/V, D 64), block 16,
    contexts up to 1,000 tokens on shuffled tables wider than any sequence needs, from an fp32 and from a bf16 cache,
    for decodes and for a verify's 5 tokens per sequence (15 rows per K/V head, more than pass 2 holds at once).
    bf16 against the fp32 result on the same bf16 values: only the output's rounding to bf16 may differ, and without
    vdpbf16ps nothing else does (the kernel's own fp32 result, rounded as torch rounds, bit for bit). Both ways
    of dealing the work: whole sequences per task (at least two sequences per thread), and one K/V head per task
    (fewer). fp16 is left to the compiled loop."""
    from solutions.attention import cpu_kernels

    if INSTRUCTION_SETS[instruction_set] and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 instruction set")
    monkeypatch.setattr(cpu_kernels, "_library", functools.partial(cpu_kernels._library,
                                                                   INSTRUCTION_SETS[instruction_set]))
    g = torch.Generator().manual_seed(7)
    key_cache, value_cache = torch.randn(400, 16, 3, 64, generator=g), torch.randn(400, 16, 3, 64, generator=g)
    seq_lens = torch.tensor([5, 16, 17, 255, 1000, 640])
    block_tables = torch.randperm(400, generator=g)[: 6 * 64].view(6, 64)
    for q in (torch.randn(6, 9, 64, generator=g), torch.randn(6, 5, 9, 64, generator=g)):
        attend = batched_decode_attention if q.dim() == 3 else verify_reference
        expected = attend(q, key_cache, value_cache, block_tables, seq_lens, 0.125)
        bf16 = [t.bfloat16() for t in (q, key_cache, value_cache)]
        expected_bf16 = attend(*(t.float() for t in bf16), block_tables, seq_lens, 0.125).bfloat16()
        threads = torch.get_num_threads()
        try:
            for num_threads, num_seqs in [(1, 6), (1, 1), (2, 3), (2, 6)]:
                torch.set_num_threads(num_threads)  # OpenMP's thread count, which the kernel deals its tasks by
                got = c_paged_decode_attention(q[:num_seqs], key_cache, value_cache, block_tables[:num_seqs],
                                               seq_lens[:num_seqs], 0.125)
                torch.testing.assert_close(got, expected[:num_seqs], rtol=1e-5, atol=1e-5)
                got = c_paged_decode_attention(bf16[0][:num_seqs], *bf16[1:], block_tables[:num_seqs],
                                               seq_lens[:num_seqs], 0.125)
                assert got.dtype == torch.bfloat16
                torch.testing.assert_close(got, expected_bf16[:num_seqs])  # bf16's tolerance: one rounding
                if INSTRUCTION_SETS[instruction_set]:  # no vdpbf16ps: fp32 arithmetic on the widened values, rounded
                    widened = c_paged_decode_attention(bf16[0][:num_seqs].float(), *(t.float() for t in bf16[1:]),
                                                       block_tables[:num_seqs], seq_lens[:num_seqs], 0.125)
                    assert torch.equal(got, widened.bfloat16()), "rounded to bf16 as torch rounds"
        finally:
            torch.set_num_threads(threads)
    assert cpu_kernels.supports(q, key_cache) and cpu_kernels.supports(*bf16[:2])
    assert not cpu_kernels.supports(q.half(), key_cache.half())


@pytest.mark.parametrize("head_dim", [128, 80, 8], ids=["d128-specialised", "d80-generic", "d8-not-a-vector"])
def test_fast_decode_attention_at_other_head_sizes(head_dim):
    """The C kernel's other head sizes: 128 (compiled as a constant, as 64 is), 80 (the generic loop) over contexts
    that end mid-vector and mid-block; a head of 8 floats is not a whole vector, so `fast_decode_attention` leaves
    it to the compiled loop, with the same result."""
    from solutions.attention import cpu_kernels
    from solutions.attention.inductor_backend import fast_decode_attention

    g = torch.Generator().manual_seed(head_dim)
    key_cache, value_cache = (torch.randn(40, 16, 2, head_dim, generator=g) for _ in range(2))
    seq_lens = torch.tensor([1, 15, 33, 100])
    block_tables = torch.randperm(40, generator=g)[:28].view(4, 7)
    q = torch.randn(4, 6, head_dim, generator=g)
    expected = batched_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, head_dim**-0.5)
    got = fast_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, head_dim**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert cpu_kernels.supports(q, key_cache) == (head_dim % cpu_kernels.LANES == 0)


# --- the compiled forward pass ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["llama-gqa", "qwen2-bias-mqa"])
def test_compiled_fast_path_equals_hugging_face_and_compiles_only_at_start_up(model):
    folder = tiny_checkpoint(model)
    llm = LLM(model=str(folder), attention_backend="inductor", **HARD)
    compiled = core(llm).model_executor.model_runner.compiled_forward
    assert compiled is not None and compiled.compile_seconds > 0, "the forward pass compiles at start-up"
    at_start = compiled.compile_seconds
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    prompts = prompts_with_a_head(18, 256, seed=4)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(folder, tuple(prompt), NEW_TOKENS)
        assert_greedy_close(output.outputs[0].token_ids, expected, prompt, hf_oracle(folder))
    engine, scheduler = llm.llm_engine, core(llm).scheduler
    assert scheduler.num_preemptions > 0, "the KV budget forces preemptions"
    assert scheduler.kv_cache_manager.prefix_cache_stats.hits > 0, "the shared head is found in the prefix cache"
    sizes = {s.num_prefill_tokens + s.num_decode_tokens for s in engine.stats.steps}
    assert 1 in sizes and len(sizes) > 5, "steps of one token and of many sizes ran"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "no step compiled a new graph"
    assert compiled.compile_seconds == at_start
    assert scheduler.kv_cache_manager.num_used_blocks == 0


def test_a_new_thread_count_does_not_recompile_the_forward():
    """The CPU thread policy changes torch's thread count as the machine's load changes; each change must not cost
    a compile (dynamo guards the count in its global state; inductor's loops may be written for one count)."""
    folder = tiny_checkpoint("llama-gqa")
    llm = LLM(model=str(folder), attention_backend="inductor", cpu_threads=2, **HARD)
    compiled, policy = core(llm).model_executor.model_runner.compiled_forward, core(llm).model_executor.cpu_threads
    at_start, graphs = compiled.compile_seconds, torch._dynamo.utils.counters["stats"]["unique_graphs"]
    prompts = prompts_with_a_head(4, 256, seed=5)
    try:
        for policy.num_threads in (1, 2, 1):  # as the policy sets it, step by step
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
            assert torch.get_num_threads() == policy.num_threads
            for prompt, output in zip(prompts, outputs, strict=True):
                expected = hf_greedy(folder, tuple(prompt), NEW_TOKENS)
                assert_greedy_close(output.outputs[0].token_ids, expected, prompt, hf_oracle(folder))
    finally:
        policy.restore()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "a thread count compiled a new graph"
    assert compiled.compile_seconds == at_start


def test_enforce_eager_keeps_the_eager_forward_with_in_place_attention():
    folder = tiny_checkpoint("llama-gqa")
    eager = LLM(model=str(folder), attention_backend="inductor", enforce_eager=True, **HARD)
    reference = LLM(model=str(folder), **HARD)
    assert core(eager).model_executor.model_runner.compiled_forward is None
    prompts = prompts_with_a_head(10, 256, seed=5)
    ours = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY, use_tqdm=False)]
    theirs = [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY, use_tqdm=False)]
    assert ours == theirs


def test_smollm2_fast_path_equals_hugging_face():
    folder = resolve_model("smollm2-135m")
    llm = LLM(model="smollm2-135m", attention_backend="inductor", **HARD)
    texts = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Paged attention"]
    prompts = [llm.tokenizer.encode(t) for t in texts] + prompts_with_a_head(12, 49152, seed=6)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(folder, tuple(prompt), NEW_TOKENS)
        assert_greedy_close(output.outputs[0].token_ids, expected, prompt, hf_oracle(folder))
    assert core(llm).scheduler.num_preemptions > 0
