"""Sliding-window checkpoints: every attention path masks a windowed layer as Hugging Face does, every token cached.

Hugging Face's rule (transformers 5.23.0, `masking_utils.py`): in a layer with window W, the query at position i
sees the keys at positions j with i - W < j <= i, its own included. The kernels are held to a naive masked
attention written here; the engine, on a tiny random Qwen2 with windowed and full layers alternating (and a
Mistral windowed throughout), to Hugging Face's greedy tokens, with prompts and outputs crossing the window many
times, under prefix caching, chunked prefill, preemption and speculative decoding.
"""

import pytest
import torch

from grading.parity import assert_greedy_close, hf_greedy, hf_oracle
from solutions import LLM, SamplingParams
from solutions.attention.cpu_kernels import c_paged_decode_attention
from solutions.attention.inductor_backend import torch_paged_decode_attention
from solutions.attention.torch_backend import batched_decode_attention, causal_context_attention, causal_self_attention
from solutions.model.config import ModelConfig
from solutions.spec_decode.draft_model import DraftAttention, DraftKVCache

WINDOW, BLOCK_SIZE, NEW_TOKENS = 32, 16, 48
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
)
QWEN2_HYBRID = dict(
    TINY, num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention"] * 2,
)
MISTRAL = dict(TINY, num_hidden_layers=2, sliding_window=24)


def save_tiny(folder, class_name: str, kwargs: dict) -> str:
    """A random-weight checkpoint of `class_name` (transformers' config class), saved as a Hugging Face folder."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, class_name)(**kwargs))
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("qwen2-window"), "Qwen2Config", QWEN2_HYBRID)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("mistral-window"), "MistralConfig", MISTRAL)


def prompts(count: int, seed: int, lengths: tuple[int, int] = (45, 110)) -> list[list[int]]:
    """`count` random prompts of `lengths` tokens; every other one after a shared head of 40 (a prefix-cache hit)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 256, (40,), generator=g).tolist()
    own = [torch.randint(0, 256, (int(torch.randint(*lengths, (1,), generator=g)),), generator=g).tolist()
           for _ in range(count)]
    return [(head + tokens)[: len(tokens)] if i % 2 == 0 else tokens for i, tokens in enumerate(own)]


def assert_equals_hugging_face(folder: str, llm: LLM, batch: list[list[int]], new_tokens: int = NEW_TOKENS) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for prompt, output in zip(batch, llm.generate(batch, params, use_tqdm=False), strict=True):
        expected = hf_greedy(folder, tuple(prompt), new_tokens)
        assert_greedy_close(output.outputs[0].token_ids, expected, prompt, hf_oracle(folder))


# --- the config -------------------------------------------------------------------------------------------------


def test_the_config_reads_each_layers_window_as_hugging_face_does():
    assert ModelConfig.from_dict(dict(QWEN2_HYBRID, architectures=["Qwen2ForCausalLM"])).sliding_windows == (
        WINDOW, None, WINDOW, None
    )
    derived = dict(QWEN2_HYBRID, architectures=["Qwen2ForCausalLM"], layer_types=None, max_window_layers=1)
    assert ModelConfig.from_dict(derived).sliding_windows == (None, WINDOW, WINDOW, WINDOW)
    assert ModelConfig.from_dict(dict(MISTRAL, architectures=["MistralForCausalLM"])).sliding_windows == (24, 24)


# --- the kernels, against naive masked attention ---------------------------------------------------------------


def naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int],
                    window: int | None, scale: float) -> torch.Tensor:
    """q (T, Hq, D) at `positions`, over one sequence's keys and values (L, Hkv, D): each query by itself, over
    the keys i - window < j <= i."""
    group = q.shape[1] // keys.shape[1]
    out = torch.empty_like(q)
    for t, i in enumerate(positions):
        lo = 0 if window is None else max(0, i - window + 1)
        k, v = keys[lo : i + 1].repeat_interleave(group, 1), values[lo : i + 1].repeat_interleave(group, 1)
        probs = (torch.einsum("hd,lhd->hl", q[t], k) * scale).softmax(-1)  # (Hq, keys seen)
        out[t] = torch.einsum("hl,lhd->hd", probs, v)
    return out


def paged_case(seq_lens: list[int], num_queries: int = 1, seed: int = 0):
    """A shuffled paged cache holding sequences of `seq_lens`, and `num_queries` queries for each sequence's last
    positions: (q (B, Q, Hq, D), key_cache, value_cache, block_tables (B, max_blocks), seq_lens (B,))."""
    g = torch.Generator().manual_seed(seed)
    max_blocks, Hkv, group, D = -(-max(seq_lens) // BLOCK_SIZE), 2, 3, 16
    num_blocks = len(seq_lens) * max_blocks + 2
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, Hkv, D, generator=g)
    value_cache = torch.randn(num_blocks, BLOCK_SIZE, Hkv, D, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    q = torch.randn(len(seq_lens), num_queries, Hkv * group, D, generator=g)
    return q, key_cache, value_cache, tables, torch.tensor(seq_lens)


def expected_paged(q, key_cache, value_cache, tables, seq_lens, window):
    """`naive_attention` of each sequence's queries, the last at position seq_len - 1, the others just before."""
    rows = []
    for b, seq_len in enumerate(seq_lens.tolist()):
        keys, values = (cache[tables[b]].flatten(0, 1)[:seq_len] for cache in (key_cache, value_cache))
        positions = list(range(seq_len - q.shape[1], seq_len))
        rows.append(naive_attention(q[b], keys, values, positions, window, q.shape[-1] ** -0.5))
    return torch.stack(rows)


SEQ_LENS = [1, 31, 32, 33, 70, 100]
WINDOWS = [None, 1, 16, 32, 40]


@pytest.mark.parametrize("window", WINDOWS)
def test_decode_attention_masks_by_the_window(window):
    q, key_cache, value_cache, tables, seq_lens = paged_case(SEQ_LENS)
    want = expected_paged(q, key_cache, value_cache, tables, seq_lens, window)[:, 0]
    # the inductor backend's loop eagerly (compiling it costs more than the rest of this file; the compiled fast
    # path's test below serves through it only where the C kernel does not apply)
    for attend in (batched_decode_attention, torch_paged_decode_attention, c_paged_decode_attention):
        got = attend(q[:, 0], key_cache, value_cache, tables, seq_lens, 16**-0.5, window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, f=attend: f"{f.__name__}: {m}")


@pytest.mark.parametrize("window", WINDOWS)
def test_the_c_kernels_verify_masks_each_query_by_its_own_position(window):
    q, key_cache, value_cache, tables, seq_lens = paged_case([5, 33, 36, 90], num_queries=4, seed=1)
    want = expected_paged(q, key_cache, value_cache, tables, seq_lens, window)
    got = c_paged_decode_attention(q, key_cache, value_cache, tables, seq_lens, 16**-0.5, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_attention_masks_by_the_window(window):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(70, heads, 16, generator=g) for heads in (6, 2, 2))
    scale = 16**-0.5
    torch.testing.assert_close(
        causal_self_attention(q, k, v, scale, window), naive_attention(q, k, v, list(range(70)), window, scale),
        rtol=1e-5, atol=1e-5,
    )
    chunk = q[45:]  # a chunk after 45 tokens of context
    torch.testing.assert_close(
        causal_context_attention(chunk, k, v, scale, window),
        naive_attention(chunk, k, v, list(range(45, 70)), window, scale), rtol=1e-5, atol=1e-5,
    )


def test_the_draft_models_attention_masks_by_the_targets_window():
    """A wrong draft costs only acceptances (the target verifies it), so the engine's tokens cannot show this."""
    config = ModelConfig.from_dict(dict(QWEN2_HYBRID, architectures=["Qwen2ForCausalLM"]))
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(70, heads, 16, generator=g) for heads in (4, 2, 2))
    cache = DraftKVCache(2, 2, 16, torch.float32, torch.device("cpu"))
    cache.reserve(70)
    for layer, window in enumerate(config.sliding_windows[:2]):  # windowed, then full
        got = DraftAttention([cache], [0, 70], config).forward(layer, q, k, v)
        torch.testing.assert_close(got, naive_attention(q, k, v, list(range(70)), window, 16**-0.5), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("window", [1, 20, 32])  # without one: tests/test_kernels.py
def test_the_unified_triton_kernel_masks_by_the_window(window):
    import kernels

    q, key_cache, value_cache, tables, seq_lens = paged_case([1, 33, 40, 75], num_queries=1, seed=3)
    query_lens = [1, 30, 1, 75]  # a decode, a chunk after a context, a decode, a whole prompt
    g = torch.Generator().manual_seed(4)
    query = torch.randn(sum(query_lens), 6, 16, generator=g)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    want = torch.cat([
        naive_attention(query[starts[b] : starts[b + 1]], key_cache[tables[b]].flatten(0, 1)[:n],
                        value_cache[tables[b]].flatten(0, 1)[:n], list(range(n - query_lens[b], n)), window, 16**-0.5)
        for b, n in enumerate(seq_lens.tolist())
    ])
    args = (query, key_cache, value_cache, tables.to(torch.int32), seq_lens.to(torch.int32), starts, 16**-0.5)
    torch.testing.assert_close(kernels.unified_attention(*args, window=window), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kernels.unified_attention_reference(*args, window=window), want, rtol=1e-5, atol=1e-5)


# --- the engine, against Hugging Face ---------------------------------------------------------------------------

# Chunked prefill (16 tokens a step), prefix-cache hits (the shared head), and preemption (KV for ~3 sequences).
HARD = dict(block_size=BLOCK_SIZE, max_num_batched_tokens=32, long_prefill_token_threshold=16, num_kv_blocks=30,
            max_num_seqs=6, max_model_len=256, enable_prefix_caching=True)
EASY = dict(block_size=BLOCK_SIZE, max_num_batched_tokens=1024, max_model_len=256, enable_prefix_caching=False)


@pytest.mark.parametrize("backend", ["torch", "inductor"])
@pytest.mark.parametrize("options", [HARD, EASY], ids=["chunked-prefix-cached-preempted", "whole-prompts"])
def test_a_hybrid_windowed_qwen2_serves_hugging_faces_tokens(qwen2, backend, options):
    llm = LLM(model=qwen2, attention_backend=backend, enforce_eager=True, **options)
    assert_equals_hugging_face(qwen2, llm, prompts(6, seed=0))
    scheduler = llm.llm_engine.engine_core.scheduler
    if options is HARD:
        assert scheduler.num_preemptions > 0, "the KV budget forces preemptions"
        assert scheduler.kv_cache_manager.prefix_cache_stats.hits > 0, "the shared head is found in the prefix cache"


@pytest.mark.parametrize("backend", ["torch", "inductor"])
def test_speculative_verify_masks_each_draft_by_its_own_position(qwen2, backend):
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "num_draft_layers": 2}
    llm = LLM(model=qwen2, attention_backend=backend, enforce_eager=True, speculative_config=spec, **EASY)
    assert_equals_hugging_face(qwen2, llm, prompts(3, seed=1))


def test_the_compiled_fast_path_serves_hugging_faces_tokens(qwen2):
    llm = LLM(model=qwen2, attention_backend="inductor", **HARD)
    assert_equals_hugging_face(qwen2, llm, prompts(3, seed=2))


def test_the_triton_backend_in_the_interpreter_serves_hugging_faces_tokens(qwen2):
    llm = LLM(model=qwen2, attention_backend="triton", **dict(HARD, max_num_batched_tokens=24))
    assert_equals_hugging_face(qwen2, llm, prompts(2, seed=3, lengths=(45, 50)), new_tokens=40)


def test_a_mistral_windowed_throughout_serves_hugging_faces_tokens(mistral):
    llm = LLM(model=mistral, enforce_eager=True, **HARD)
    assert_equals_hugging_face(mistral, llm, prompts(4, seed=4))
