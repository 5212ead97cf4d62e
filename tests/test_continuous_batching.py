"""Continuous batching end to end: HF-identical greedy tokens under preemption, chunked prefill, prefix caching,
priorities and late arrivals; seeded sampling independent of the batch; overload; abort in every state; bad
input rejected without disturbing requests in flight; the batched attention path against chapter 3's oracle."""

import random
from pathlib import Path

import pytest
import torch

from grading.parity import assert_greedy_close, hf_greedy, hf_oracle
from grading.tiny_models import tiny_checkpoint
from solutions import LLM, SamplingParams
from solutions.attention.paged import AttentionMetadata, paged_attention, write_to_kv_cache
from solutions.attention.inductor_backend import InductorAttentionBackend
from solutions.attention.torch_backend import TorchAttentionBackend
from solutions.attention.paged import KVCache
from solutions.core.sequence import SequenceStatus
from solutions.model.loader import resolve_model

NEW_TOKENS = 24


def core(llm: LLM):
    """The engine core behind `llm`, through its in-process client: its scheduler (and KV cache manager), its
    model executor."""
    return llm.llm_engine.engine_core


def mixed_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of 1 to 80 tokens; every fourth starts with the same 40 tokens (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, vocab_size) for _ in range(40)]
    prompts = []
    for i in range(count):
        own = [rng.randrange(100 if vocab_size > 1000 else 0, vocab_size) for _ in range(rng.randint(1, 80))]
        prompts.append(shared + own[:20] if i % 4 == 0 else own)
    return prompts


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

CONFIGS = {
    # KV for about 9 of the 32 sequences at once: many preemptions by recompute
    "preemption": dict(block_size=8, num_kv_blocks=120, enable_prefix_caching=False),
    # a 24-token budget: prompts are prefilled in chunks beside running decodes
    "chunked-prefill": dict(block_size=16, max_num_batched_tokens=24, long_prefill_token_threshold=16),
    # prefix caching with a tight cache: hits, evictions and preemption together
    "prefix-caching": dict(block_size=4, num_kv_blocks=200, enable_prefix_caching=True),
    "priority": dict(block_size=8, num_kv_blocks=100, scheduling_policy="priority", max_num_seqs=6),
}


def run_config(folder: Path, prompts: list[list[int]], config: str) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=str(folder), max_model_len=256, **CONFIGS[config])
    if config == "priority":
        priorities = [(i * 7) % 5 - 2 for i in range(len(prompts))]
        outputs = llm.generate(prompts, GREEDY, priority=priorities, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


def check_against_hf(folder: Path, prompts: list[list[int]], tokens: list[list[int]]) -> None:
    for prompt, ours in zip(prompts, tokens, strict=True):
        assert_greedy_close(ours, hf_greedy(folder, tuple(prompt), NEW_TOKENS), prompt, hf_oracle(folder))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("model", ["llama-gqa", "qwen2-bias-mqa"])
def test_tiny_greedy_equals_hugging_face(model, config):
    folder = tiny_checkpoint(model)
    prompts = mixed_prompts(32, 256, seed=1)
    llm, tokens = run_config(folder, prompts, config)
    check_against_hf(folder, prompts, tokens)
    engine, scheduler = llm.llm_engine, core(llm).scheduler
    assert scheduler.kv_cache_manager.num_used_blocks == 0, "every block is free once all requests finish"
    if config == "preemption":
        assert scheduler.num_preemptions >= 5, "the KV budget forces preemptions"
    if config == "chunked-prefill":
        assert max(s.num_prefill_tokens + s.num_decode_tokens for s in engine.stats.steps) <= 24
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in engine.stats.steps), "chunks share steps with decodes"
    if config == "prefix-caching":
        assert scheduler.kv_cache_manager.prefix_cache_stats.hits > 0


@pytest.fixture(scope="module")
def smollm2_prompts() -> list[list[int]]:
    return mixed_prompts(32, 49152, seed=2)


@pytest.mark.parametrize("config", CONFIGS)
def test_smollm2_greedy_equals_hugging_face(config, smollm2_prompts):
    folder = resolve_model("smollm2-135m")
    llm, tokens = run_config(folder, smollm2_prompts, config)
    check_against_hf(folder, smollm2_prompts, tokens)
    assert core(llm).scheduler.kv_cache_manager.num_used_blocks == 0


def test_requests_added_mid_decode_equal_hugging_face():
    folder = tiny_checkpoint("llama-gqa")
    llm = LLM(model=str(folder), block_size=8, num_kv_blocks=60, max_model_len=256)
    engine, prompts = llm.llm_engine, mixed_prompts(12, 256, seed=3)
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts[:4]):
        engine.add_request(str(i), prompt, GREEDY)
    pending = list(enumerate(prompts))[4:]
    step = 0
    while engine.has_unfinished_requests() or pending:
        if pending and step % 3 == 2:  # a new request every third step, while the others decode
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, GREEDY)
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
        step += 1
    check_against_hf(folder, prompts, [tokens[str(i)] for i in range(len(prompts))])


def test_a_seeded_request_samples_the_same_alone_and_in_a_full_batch():
    llm = LLM(model=str(tiny_checkpoint("llama-gqa")), max_model_len=256)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, max_tokens=20, seed=1234)
    alone = llm.generate([[5, 6, 7, 8]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = mixed_prompts(20, 256, seed=4)
    crowd = [SamplingParams(temperature=1.0, max_tokens=20)] * 10 + [GREEDY] * 10
    outputs = llm.generate([*others[:10], [5, 6, 7, 8], *others[10:]], [*crowd[:10], seeded, *crowd[10:]], use_tqdm=False)
    assert outputs[10].outputs[0].token_ids == alone


def test_overload_500_requests_through_room_for_10():
    folder = tiny_checkpoint("qwen2-bias-mqa")
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 24))] for _ in range(500)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    free = LLM(model=str(folder), max_model_len=64, max_num_seqs=512, block_size=8)
    expected = [o.outputs[0].token_ids for o in free.generate(prompts, params, use_tqdm=False)]
    tight = LLM(model=str(folder), max_model_len=64, max_num_seqs=512, block_size=8, num_kv_blocks=40)  # ~10 × 32 tokens
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    engine = tight.llm_engine
    assert core(tight).scheduler.kv_cache_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()
    assert max(s.num_running for s in engine.stats.steps) <= 40


# --- abort and bad input -----------------------------------------------------------------------------------


def drive_until(engine, predicate, outputs: dict[str, list[int]], limit: int = 200) -> None:
    """Step until `predicate()` holds, collecting every request's new tokens into `outputs`."""
    for _ in range(limit):
        if predicate():
            return
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
    raise AssertionError("the state was never reached")


@pytest.mark.parametrize("state", ["waiting", "mid-prefill-chunk", "running", "preempted"])
def test_abort_in_every_state_frees_everything(state):
    folder = tiny_checkpoint("llama-gqa")
    if state == "preempted":
        llm = LLM(model=str(folder), block_size=4, num_kv_blocks=14, max_model_len=56, enable_prefix_caching=False)
    else:
        llm = LLM(model=str(folder), block_size=4, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=128)
    engine, scheduler = llm.llm_engine, core(llm).scheduler
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(1, 25 if state == "mid-prefill-chunk" else 9)), params)
    seqs = {f"r{i}": scheduler.requests[f"r{i}"][0] for i in range(3)}
    wanted = {
        "waiting": lambda: seqs["r2"].status is SequenceStatus.WAITING,
        "mid-prefill-chunk": lambda: 0 < seqs["r0"].num_computed_tokens < seqs["r0"].num_prompt_tokens,
        "running": lambda: seqs["r1"].status is SequenceStatus.RUNNING and seqs["r1"].num_output_tokens > 1,
        "preempted": lambda: any(s.status is SequenceStatus.PREEMPTED for s in seqs.values()),
    }[state]
    outputs: dict[str, list[int]] = {}
    drive_until(engine, wanted, outputs)
    victim = {"waiting": "r2", "mid-prefill-chunk": "r0", "running": "r1"}.get(state) or next(
        r for r, s in seqs.items() if s.status is SequenceStatus.PREEMPTED
    )
    engine.abort_request(victim)
    assert seqs[victim].status is SequenceStatus.FINISHED_ABORTED and not seqs[victim].block_table
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
    assert victim not in engine.output_processor.request_states and victim not in scheduler.requests
    assert scheduler.kv_cache_manager.num_used_blocks == 0
    others = [r for r in seqs if r != victim]
    assert [len(outputs[r]) for r in others] == [30, 30], "the others finish normally"


def test_samples_of_n_count_against_max_num_seqs_from_admission():
    """The scheduler forks an `n > 1` request's samples when its prompt is computed, inside `schedule()`: the
    running set never changes after a step is scheduled, and never holds more than `max_num_seqs`."""
    llm = LLM(model=str(tiny_checkpoint("llama-gqa")), block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    engine = llm.llm_engine
    engine.add_request("n3", list(range(10, 19)), SamplingParams(n=3, temperature=0.0, max_tokens=5, ignore_eos=True))
    for i in range(3):
        engine.add_request(f"r{i}", [3 + i, 4, 5], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    running, tokens = [], {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            for completion in output.outputs:
                tokens.setdefault((output.request_id, completion.index), []).extend(completion.token_ids)
        running.append(len(core(llm).scheduler.running))
    assert max(running) <= 4, f"running sequences per step: {running}"
    assert running[0] == 4, "n3 (3 seats) and r0 start together; r1 and r2 wait for a seat"
    assert sorted(tokens) == [("n3", 0), ("n3", 1), ("n3", 2), ("r0", 0), ("r1", 0), ("r2", 0)]
    assert all(len(t) == 5 for t in tokens.values()) and tokens[("n3", 0)] == tokens[("n3", 1)] == tokens[("n3", 2)]
    assert core(llm).scheduler.kv_cache_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ([], {}, "is empty"),
        (list(range(1, 70)), {}, "must be shorter than max_model_len=64"),
        ([1, 2, 999], {}, "must lie in [0, 256)"),
        ([1, 2], {"max_tokens": 0}, "SamplingParams.max_tokens must be an int >= 1, got 0"),
        ([1, 2], {"temperature": -0.1}, "SamplingParams.temperature must be a number >= 0, got -0.1"),
        ([1, 2], {"top_p": 0.0}, "SamplingParams.top_p must be in (0, 1], got 0.0"),
        ([1, 2], {"top_p": 1.01}, "SamplingParams.top_p must be in (0, 1], got 1.01"),
        ([1, 2], {"min_p": 1.5}, "SamplingParams.min_p must be in [0, 1], got 1.5"),
        ([1, 2], {"min_p": -0.5}, "SamplingParams.min_p must be in [0, 1], got -0.5"),
        ([1, 2], {"n": 0}, "SamplingParams.n must be an int >= 1, got 0"),
        ([1, 2], {"n": 65}, "n=65 of request 'bad' exceeds max_num_seqs=64"),
    ],
)
def test_bad_input_is_named_and_requests_in_flight_finish(prompt, params, message):
    llm = LLM(model=str(tiny_checkpoint("llama-gqa")), max_model_len=64)
    engine = llm.llm_engine
    ok = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("in-flight", [3, 4, 5], ok)
    tokens = engine.step()[0].outputs[0].token_ids  # its prefill and first token
    with pytest.raises(ValueError) as error:
        engine.add_request("bad", prompt, SamplingParams(**params) if params else ok)
    assert message in str(error.value)
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += output.outputs[0].token_ids
    assert len(tokens) == 10 and core(llm).scheduler.kv_cache_manager.num_used_blocks == 0
    assert tokens == llm.generate([[3, 4, 5]], ok, use_tqdm=False)[0].outputs[0].token_ids


def test_aborting_an_unknown_request_id_names_it_and_changes_nothing():
    llm = LLM(model=str(tiny_checkpoint("llama-gqa")), max_model_len=64)
    engine = llm.llm_engine
    engine.add_request("known", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(ValueError, match=r"unknown request ids \['nope'\]"):
        engine.abort_request(["known", "nope"])
    # the valid id in the same call was not aborted either, in the front end or in the engine core
    assert "known" in engine.output_processor.request_states and "known" in core(llm).scheduler.requests
    assert not core(llm).scheduler.requests["known"][0].is_finished


# --- the batched attention paths against chapter 3's per-sequence oracle ------------------------------------


@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, InductorAttentionBackend], ids=["torch", "inductor"])
@pytest.mark.parametrize("seed", range(4))
def test_batched_backend_equals_per_sequence_paged_attention(seed, backend_cls):
    g = torch.Generator().manual_seed(seed)
    num_blocks, block_size, Hkv, Hq, D = 40, 4, 2, 6, 8
    cache = KVCache([torch.randn(num_blocks, block_size, Hkv, D, generator=g)], [torch.randn(num_blocks, block_size, Hkv, D, generator=g)])
    free = torch.randperm(num_blocks, generator=g).tolist()
    # a mixed step: decodes, a fresh prompt, a later prefill chunk with context
    query_lens, context_lens = [1, 5, 1, 3, 1], [9, 0, 14, 6, 1]
    tables, slots, starts = [], [], [0]
    for q_len, ctx in zip(query_lens, context_lens, strict=True):
        n = -(-(ctx + q_len) // block_size)
        table = [free.pop() for _ in range(n)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + q_len)]
        starts.append(starts[-1] + q_len)
    T = starts[-1]
    metadata = AttentionMetadata(torch.tensor(slots), torch.tensor(starts), torch.tensor([c + q for c, q in zip(context_lens, query_lens)]), tables)
    q, k, v = torch.randn(T, Hq, D, generator=g), torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    oracle_cache = KVCache([cache.key_caches[0].clone()], [cache.value_caches[0].clone()])
    write_to_kv_cache(k, v, oracle_cache.key_caches[0], oracle_cache.value_caches[0], metadata.slot_mapping)
    expected = paged_attention(q, oracle_cache.key_caches[0], oracle_cache.value_caches[0], metadata, D**-0.5)
    got = backend_cls(cache, metadata).forward(0, q, k, v)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# --- streaming and logprobs --------------------------------------------------------------------------------


def test_streamed_deltas_add_up_to_the_final_output(smollm2_llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=[" Paris."])
    prompt = smollm2_llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}], tokenize=False,
        add_generation_prompt=True,
    )
    (final,) = smollm2_llm.generate(prompt, params, use_tqdm=False)
    engine = smollm2_llm.llm_engine
    engine.add_request("stream", prompt, params)
    text, tokens, outputs = "", [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.append(output)
            text += output.outputs[0].text
            tokens += output.outputs[0].token_ids
    assert len(outputs) > 3, "a request reports something at (nearly) every step"
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert text == final.outputs[0].text and tokens == final.outputs[0].token_ids
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == " Paris."
    assert " Paris." not in text, "the stop string is cut from the text, also while streaming"


@pytest.fixture(scope="module")
def smollm2_llm() -> LLM:
    return LLM(model="smollm2-135m", max_model_len=256, max_num_seqs=8)


def test_logprobs_are_the_models_log_softmax():
    folder = tiny_checkpoint("llama-gqa")
    llm = LLM(model=str(folder), max_model_len=64)
    prompt = [1, 2, 3, 4, 5]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    completion = out.outputs[0]
    assert len(completion.logprobs) == 6
    with torch.inference_mode():
        logits = hf_oracle(folder)(torch.tensor([prompt + completion.token_ids])).logits[0]  # (T, V)
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1].double(), dim=-1)  # (6, V): the step predicting each token
    total = 0.0
    for step, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        top3 = expected[step].topk(3)
        assert list(entry)[:3] == top3.indices.tolist(), "the top 3, most likely first"
        for token, logprob in entry.items():
            assert logprob.logprob == pytest.approx(float(expected[step, token]), abs=1e-4)
        assert entry[token_id].rank == 1  # greedy: the sampled token is the most likely
        total += entry[token_id].logprob
    assert completion.cumulative_logprob == pytest.approx(total)
