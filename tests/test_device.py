"""The engine's device and dtype: `LLM(device=..., dtype=..., enforce_eager=...)`, and decode steps as CUDA graphs.

On any machine: the arguments are checked at the boundary; a bfloat16 engine really holds bfloat16 weights and KV
cache (sized by its element size) and generates the float32 engine's greedy tokens on a tiny model; the CUDA-graph
bucketing and padding are checked as plain Python, and the padded static-buffer decode path — exactly what a graph
replays — runs eagerly through the Triton kernels (interpreted on a CPU) with the eager engine's tokens, never
writing the cache from a padding row. With a GPU: SmolLM2 in float32 on CUDA with graphs gives Hugging Face's
greedy tokens, and graphs on equal graphs off.
"""

import pytest
import torch

from grading.devices import DEVICE
from grading.tiny_models import tiny_checkpoint
from solutions import LLM, SamplingParams
from solutions.attention.paged import AttentionMetadata, KVCache
from solutions.worker.cuda_graph import PAD_SLOT_ID, CUDAGraphRunner, bucket_for, capture_sizes, pad_decode_batch

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j + 1) % 256 for j in range(n)] for i, n in enumerate([5, 16, 23, 40, 9])]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def core(llm: LLM):
    """The engine core behind `llm`, through its in-process client: its scheduler (and KV cache manager), its
    model executor."""
    return llm.llm_engine.engine_core


def runner_of(llm: LLM):
    """The model runner of `llm`'s engine core (the model, the KV cache, the CUDA graphs)."""
    return core(llm).model_executor.model_runner


def tiny_llm(**kwargs) -> LLM:
    return LLM(model=str(tiny_checkpoint("llama-gqa")), block_size=16, max_num_seqs=8, max_model_len=128, **kwargs)


def greedy_tokens(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


# --- arguments -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(device="tpu"), "device must be one of"),
        (dict(device="cuda:0"), "device must be one of"),
        (dict(dtype="float64"), "dtype must be one of"),
        (dict(dtype="fp16"), "dtype must be one of"),
        (dict(device="cpu", dtype="float16"), "dtype='float16' is not supported on device='cpu'"),
        (dict(enforce_eager="no"), "enforce_eager must be True or False"),
    ],
)
def test_bad_device_dtype_or_enforce_eager_is_a_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        tiny_llm(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_says_so():
    with pytest.raises(ValueError, match=r"device='cuda' but PyTorch sees no CUDA GPU"):
        tiny_llm(device="cuda")


# --- dtype plumbing on the CPU ---------------------------------------------------------------------------------


NUM_LOGPROBS = 5  # as vLLM's model tests compare dtypes (`check_logprobs_close` with 5 logprobs)
TOP_N = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=NUM_LOGPROBS)


def assert_greedy_streams_close(ours: LLM, theirs: LLM, prompts: list[list[int]]) -> None:
    """vLLM's `check_logprobs_close` rule between two engines: equal token ids, or at the first divergence each
    engine's token is among the other's top-5 (a close call that rounding may flip); the streams are different
    texts after that. A tiny random model has close calls, and bfloat16 keeps 8 bits of mantissa, so a bfloat16
    engine parts from float32 now and then; a wrong dtype path (RoPE angles rounded to bf16, a cache in the wrong
    dtype) picks tokens far outside the top-5 of a 256-token vocabulary."""
    a_outs, b_outs = (llm.generate(prompts, TOP_N, use_tqdm=False) for llm in (ours, theirs))
    for prompt, a_out, b_out in zip(prompts, a_outs, b_outs, strict=True):
        a, b = a_out.outputs[0], b_out.outputs[0]
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if x != y:
                a_top = {t for t, lp in a.logprobs[i].items() if lp.rank <= NUM_LOGPROBS}
                b_top = {t for t, lp in b.logprobs[i].items() if lp.rank <= NUM_LOGPROBS}
                assert x in b_top and y in a_top, (
                    f"prompt {prompt}: token {i} is {x} vs {y}, top-{NUM_LOGPROBS} {sorted(a_top)} vs {sorted(b_top)}"
                )
                break


def random_prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (count,), generator=g).tolist()
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def test_bfloat16_engine_holds_bfloat16_weights_and_cache_and_agrees_with_float32():
    fp32, bf16 = tiny_llm(), tiny_llm(dtype="bfloat16")
    model = runner_of(bf16).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32, "RoPE's frequencies stay float32"
    cache = runner_of(bf16).kv_cache
    assert {t.dtype for t in cache.key_caches + cache.value_caches} == {torch.bfloat16}
    assert_greedy_streams_close(bf16, fp32, random_prompts(16))


def test_bfloat16_through_the_triton_kernels_agrees_with_float32():
    """On DEVICE: natively on a GPU (graphs on), in the interpreter on the CPU."""
    bf16 = tiny_llm(attention_backend="triton", dtype="bfloat16", device=DEVICE.type)
    assert runner_of(bf16).kv_cache.key_caches[0].dtype == torch.bfloat16
    assert_greedy_streams_close(bf16, tiny_llm(attention_backend="triton", device=DEVICE.type), random_prompts(4))


def test_bfloat16_fast_path_reads_its_cache_in_the_c_kernel_and_agrees_with_float32():
    """The CPU fast path in bf16: decodes (and prefills, in pieces) go to the C kernel, which reads the bf16 cache as
    it lies (computing in fp32), not to the compiled loop; its greedy streams stay close to float32's."""
    from solutions.attention import cpu_kernels

    bf16 = tiny_llm(attention_backend="inductor", dtype="bfloat16", enforce_eager=True)
    key_cache = runner_of(bf16).kv_cache.key_caches[0]
    config = runner_of(bf16).model.config
    q = key_cache.new_zeros(1, config.num_attention_heads, key_cache.shape[3])
    assert key_cache.dtype == torch.bfloat16 and cpu_kernels.supports(q, key_cache)
    assert_greedy_streams_close(bf16, tiny_llm(attention_backend="inductor", enforce_eager=True), random_prompts(16))


def test_kv_cache_sizing_counts_the_dtype_bytes():
    budget = 2**20
    blocks = {
        dtype: core(LLM(model=str(tiny_checkpoint("llama-gqa")), block_size=16, max_num_seqs=64, max_model_len=512,
                        kv_cache_memory_bytes=budget, dtype=dtype)).scheduler.kv_cache_manager.num_blocks
        for dtype in ("float32", "bfloat16")
    }
    config = runner_of(tiny_llm()).model.config
    assert blocks["float32"] == budget // KVCache.bytes_per_block(config, 16, torch.float32)
    assert blocks["bfloat16"] == 2 * blocks["float32"], "half the bytes per element: twice the blocks"


# --- CUDA graphs: sizes, buckets, padding (pure Python) --------------------------------------------------------


@pytest.mark.parametrize(
    "max_num_seqs, sizes",
    [(1, [1]), (2, [1, 2]), (8, [1, 2, 4, 8]), (48, [1, 2, 4, 8, 16, 32, 48]), (64, [1, 2, 4, 8, 16, 32, 64])],
)
def test_capture_sizes_are_powers_of_two_up_to_max_num_seqs(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes


@pytest.mark.parametrize("num_seqs, bucket", [(1, 1), (2, 2), (3, 4), (5, 8), (17, 32), (33, 48), (48, 48), (49, None)])
def test_a_batch_replays_the_smallest_graph_that_holds_it(num_seqs, bucket):
    assert bucket_for(num_seqs, capture_sizes(48)) == bucket


def decode_metadata(tables: list[list[int]], seq_lens: list[int], block_size: int = 4) -> AttentionMetadata:
    slots = [table[(n - 1) // block_size] * block_size + (n - 1) % block_size for table, n in zip(tables, seq_lens)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(len(tables) + 1),
        seq_lens=torch.tensor(seq_lens), block_tables=tables,
    )


def test_padded_decode_batch_keeps_the_real_rows_and_neutralises_the_padding():
    metadata = decode_metadata([[5, 2], [7], [3, 1, 4]], [6, 3, 9])
    padded = pad_decode_batch(torch.tensor([11, 12, 13]), torch.tensor([5, 2, 8]), metadata, num_rows=4, max_blocks=5)
    assert padded.input_ids.tolist() == [11, 12, 13, 0]
    assert padded.positions.tolist() == [5, 2, 8, 0]
    assert padded.slot_mapping.tolist() == [9, 30, 16, PAD_SLOT_ID], "padding writes nowhere"
    assert padded.seq_lens.tolist() == [6, 3, 9, 1], "padding reads one slot (an empty context would divide 0 by 0)"
    assert padded.seq_lens.dtype == padded.block_tables.dtype == torch.int32
    assert padded.block_tables.tolist() == [[5, 2, 0, 0, 0], [7, 0, 0, 0, 0], [3, 1, 4, 0, 0], [0, 0, 0, 0, 0]]


def test_padding_refuses_what_a_graph_cannot_replay():
    metadata = decode_metadata([[5, 2], [7]], [6, 3])
    with pytest.raises(ValueError, match="does not fit a graph of 1 rows"):
        pad_decode_batch(torch.tensor([1, 2]), torch.tensor([5, 2]), metadata, num_rows=1, max_blocks=4)
    with pytest.raises(ValueError, match="2 blocks does not fit the graph's 1 columns"):
        pad_decode_batch(torch.tensor([1, 2]), torch.tensor([5, 2]), metadata, num_rows=2, max_blocks=1)
    prefill = AttentionMetadata(torch.tensor([0, 1, 2]), torch.tensor([0, 3]), torch.tensor([3]), [[0]])
    with pytest.raises(ValueError, match="one new token per sequence"):
        pad_decode_batch(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), prefill, num_rows=4, max_blocks=4)


# --- the padded static-buffer decode path, eagerly (what a graph replays) -------------------------------------


def test_padded_decode_path_gives_the_eager_tokens_and_serves_every_decode_step():
    """With the graph runner in place but nothing captured (capture=False), every pure-decode step goes through
    the static buffers padded to its bucket: 5 prompts decode in a bucket of 8, then fewer as they finish."""
    want = greedy_tokens(tiny_llm(attention_backend="triton", device=DEVICE.type, enforce_eager=True))
    llm = tiny_llm(attention_backend="triton", device=DEVICE.type, enforce_eager=True)
    runner = runner_of(llm)
    assert runner.cuda_graphs is None, "no graphs when eager"
    runner.cuda_graphs = CUDAGraphRunner(runner.model, runner.kv_cache, max_num_seqs=8, max_model_len=128,
                                         block_size=16, forward_logits=runner.forward_logits, capture=False)
    assert greedy_tokens(llm) == want
    assert runner.cuda_graphs.num_replays == GREEDY.max_tokens - 1, "every step after the prefill is a pure decode"


def test_compiled_forward_in_the_padded_decode_path_gives_the_eager_tokens():
    """What a GPU captures when it compiles (issue 42): the compiled forward pass (inductor; attention an opaque op
    calling the Triton backend) and the LM head over the static buffers, for prefills unpadded and for every decode
    step padded to its bucket. Run here on whatever device is present, without capture."""
    from solutions.worker.compiled_forward import CompiledForward

    want = greedy_tokens(tiny_llm(attention_backend="triton", device=DEVICE.type, enforce_eager=True))
    llm = tiny_llm(attention_backend="triton", device=DEVICE.type, enforce_eager=True)
    runner = runner_of(llm)
    runner.compiled_forward = CompiledForward(runner.model)
    runner.warm_up()  # as a GPU's runner does before capturing: dummy prefill and decode steps, compiled
    runner.cuda_graphs = CUDAGraphRunner(runner.model, runner.kv_cache, max_num_seqs=8, max_model_len=128,
                                         block_size=16, forward_logits=runner.forward_logits, capture=False)
    assert greedy_tokens(llm) == want
    assert runner.cuda_graphs.num_replays == GREEDY.max_tokens - 1
    assert runner.compiled_forward.compile_seconds > 0, "the forward pass ran compiled"


def test_padding_rows_never_write_the_cache():
    from grading.tiny_models import tiny_model

    model = tiny_model("llama-gqa").to(DEVICE)
    kv_cache = KVCache.allocate(model.config, num_blocks=6, block_size=4, device=DEVICE)
    for cache in kv_cache.key_caches + kv_cache.value_caches:
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(0)))
    before = [cache.clone() for cache in kv_cache.key_caches + kv_cache.value_caches]
    def eager(input_ids, positions, last_rows, backend):
        return model.compute_logits(model(input_ids, positions, backend)[last_rows])

    graphs = CUDAGraphRunner(model, kv_cache, max_num_seqs=8, max_model_len=16, block_size=4, forward_logits=eager,
                             capture=False)
    metadata = decode_metadata([[5, 2], [3], [1, 4]], [6, 3, 5])  # 3 sequences, bucket 4: one padding row
    logits = graphs.run(torch.tensor([9, 8, 7]), torch.tensor([5, 2, 4]), metadata)  # host inputs, as the engine gives
    assert logits.shape == (3, model.config.vocab_size) and torch.isfinite(logits).all()
    written = set(metadata.slot_mapping.tolist())
    for old, new in zip(before, kv_cache.key_caches + kv_cache.value_caches):
        changed = (old != new).flatten(2).any(-1).flatten().cpu()  # (num_blocks * block_size,) slots that changed
        assert set(changed.nonzero().flatten().tolist()) == written, "only the real rows' slots are written"


# --- on a GPU ---------------------------------------------------------------------------------------------------


@needs_cuda
def test_cuda_float32_greedy_matches_hugging_face_with_graphs():
    from grading.capstone import CAPSTONE_PROMPTS, smollm2_greedy
    from grading.parity import assert_greedy_close
    from grading.tiny_models import hf_model
    from solutions.model.loader import resolve_model

    llm = LLM(model="smollm2-135m", device="cuda", dtype="float32", attention_backend="triton", max_num_seqs=8,
              max_model_len=512)
    assert runner_of(llm).cuda_graphs is not None
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(CAPSTONE_PROMPTS, params, use_tqdm=False)
    assert runner_of(llm).cuda_graphs.num_replays > 0
    oracle = None
    for i, (prompt, output) in enumerate(zip(CAPSTONE_PROMPTS, outputs, strict=True)):
        theirs = smollm2_greedy(i, 32)
        if output.outputs[0].token_ids != theirs:  # a float near-tie may flip: then each must be in the other's top-2
            oracle = oracle or hf_model(resolve_model("smollm2-135m"))
            assert_greedy_close(output.outputs[0].token_ids, theirs, prompt, oracle)


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_on_equal_graphs_off(dtype):
    folder = str(tiny_checkpoint("llama-gqa"))
    tokens = {}
    for eager in (True, False):
        llm = LLM(model=folder, device="cuda", dtype=dtype, attention_backend="triton", max_num_seqs=8,
                  max_model_len=128, enforce_eager=eager)
        assert (runner_of(llm).cuda_graphs is None) == eager
        tokens[eager] = greedy_tokens(llm)
        assert {t.device.type for t in runner_of(llm).kv_cache.key_caches} == {"cuda"}
    assert tokens[False] == tokens[True]


@needs_cuda
def test_cuda_torch_backend_matches_the_cpu_engine():
    assert greedy_tokens(tiny_llm(device="cuda")) == greedy_tokens(tiny_llm())


@needs_cuda
def test_triton_on_the_cpu_beside_a_gpu_is_a_value_error_saying_use_cuda():
    """With a GPU present the kernels compile for it and the interpreter is off: a CPU engine cannot run them."""
    with pytest.raises(ValueError, match=r"attention_backend='triton' with device='cpu'.*Use device='cuda'"):
        tiny_llm(attention_backend="triton")
