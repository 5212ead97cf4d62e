"""Orca's admission inside the paged engine (`kv_reservation`): whole reservations taken at admission, requests
that wait when theirs does not fit, the same greedy tokens as paged allocation, and every block back."""

import pytest

from grading.tiny_models import tiny_checkpoint
from solutions import LLM, SamplingParams
from solutions.utils.math_utils import cdiv

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
POLICIES = ("max", "pow2", "oracle")


def core(llm: LLM):
    """The engine core behind `llm`, through its in-process client: its scheduler (and KV cache manager), its
    model executor."""
    return llm.llm_engine.engine_core


def engine_args(**overrides) -> dict:
    args = dict(block_size=BLOCK_SIZE, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16)
    return args | overrides


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(tiny_checkpoint("llama-gqa"))


@pytest.fixture(scope="module")
def llms(model_path) -> dict[str | None, LLM]:
    """One engine per allocation: paged (None) and the three Orca reservations, same model and pool."""
    return {policy: LLM(model=model_path, kv_reservation=policy, **engine_args()) for policy in (None, *POLICIES)}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompt(length: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 250 + 3 for i in range(length)]


@pytest.mark.parametrize("policy, reserved", [("max", MAX_MODEL_LEN), ("pow2", 10 + 16), ("oracle", 10 + 9)])
def test_the_whole_reservation_is_taken_at_admission_and_never_grows(llms, policy, reserved):
    engine, scheduler = llms[policy].llm_engine, core(llms[policy]).scheduler
    engine.add_request("r", prompt(10), greedy(max_tokens=9))
    seq = scheduler.requests["r"][0]
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        used.append(scheduler.kv_cache_manager.num_used_blocks)
        if engine.has_unfinished_requests():
            assert len(seq.block_table) == cdiv(reserved, BLOCK_SIZE)
    assert used[:-1] == [cdiv(reserved, BLOCK_SIZE)] * (len(used) - 1)  # from the first step to the last
    assert used[-1] == 0


def test_paged_allocation_grows_with_the_sequence(llms):
    engine = llms[None].llm_engine
    engine.add_request("r", prompt(10), greedy(max_tokens=9))
    seq = core(llms[None]).scheduler.requests["r"][0]
    engine.step()
    assert len(seq.block_table) == cdiv(10, BLOCK_SIZE)  # only the computed tokens: 3 blocks, not 5
    while engine.has_unfinished_requests():
        engine.step()


def test_a_request_whose_reservation_does_not_fit_waits(model_path):
    # 16 blocks of 4 = one max_model_len: under Orca (Max) one request at a time, under paged both at once.
    for policy, running_together in ((None, 2), ("max", 1)):
        llm = LLM(model=model_path, kv_reservation=policy, **engine_args(num_kv_blocks=16))
        engine, scheduler = llm.llm_engine, core(llm).scheduler
        engine.add_request("a", prompt(10), greedy(max_tokens=6))
        engine.add_request("b", prompt(10, offset=1), greedy(max_tokens=6))
        engine.step()
        assert len(scheduler.running) == running_together
        assert len(scheduler.waiting) == 2 - running_together
        while engine.has_unfinished_requests():
            engine.step()
        assert scheduler.num_preemptions == 0
        assert scheduler.kv_cache_manager.num_used_blocks == 0


def test_a_reserving_engine_never_preempts_where_the_paged_one_must(model_path):
    # 16 blocks of 4: four requests of 6 + 26 tokens (8 blocks each) fit as prompts, not as finished sequences.
    requests = [prompt(6, offset=i) for i in range(4)]
    preemptions = {}
    for policy in (None, "oracle"):
        llm = LLM(model=model_path, kv_reservation=policy, **engine_args(num_kv_blocks=16, max_model_len=32))
        llm.generate(requests, greedy(max_tokens=26), use_tqdm=False)
        preemptions[policy] = core(llm).scheduler.num_preemptions
    assert preemptions[None] > 0
    assert preemptions["oracle"] == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_tokens_equal_the_paged_engines(llms, policy):
    # A shared 8-token prefix (prefix-cache hits count towards the reservation) and prompts longer than the
    # 16-token step budget (chunked prefill: the reservation is taken with the first chunk).
    prompts = [prompt(8) + prompt(n, offset=n) for n in (3, 12, 20, 30)]
    params = [greedy(max_tokens=m) for m in (12, 5, 9, 20)]
    expected = [out.outputs[0].token_ids for out in llms[None].generate(prompts, params, use_tqdm=False)]
    got = [out.outputs[0].token_ids for out in llms[policy].generate(prompts, params, use_tqdm=False)]
    assert got == expected


@pytest.mark.parametrize("policy", POLICIES)
def test_every_block_comes_back_after_finish_and_abort(llms, policy):
    engine = llms[policy].llm_engine
    manager = core(llms[policy]).scheduler.kv_cache_manager
    for i in range(6):
        engine.add_request(f"r{i}", prompt(12, offset=i), greedy(max_tokens=40))
    engine.step()
    engine.step()
    engine.abort_request(["r0", "r5"])  # one running, one still waiting (Max admits 4 of 6 in 64 blocks)
    while engine.has_unfinished_requests():
        engine.step()
    assert manager.num_used_blocks == 0
    assert manager._reserved_tokens == {}


def test_bad_kv_reservation_names_the_field(model_path):
    with pytest.raises(ValueError, match=r"kv_reservation must be one of \('max', 'pow2', 'oracle'\)"):
        LLM(model=model_path, kv_reservation="lifo")


def test_a_pool_smaller_than_one_reservation_is_refused(model_path):
    with pytest.raises(ValueError, match="num_kv_blocks=8 cannot hold one reservation"):
        LLM(model=model_path, kv_reservation="oracle", **engine_args(num_kv_blocks=8))


def test_parallel_samples_are_refused_and_disturb_nothing(llms):
    engine = llms["pow2"].llm_engine
    manager = core(llms["pow2"]).scheduler.kv_cache_manager
    with pytest.raises(ValueError, match="n must be 1 with kv_reservation"):
        engine.add_request("r", prompt(5), SamplingParams(n=2, max_tokens=4))
    assert not engine.has_unfinished_requests()
    assert manager._reserved_tokens == {} and manager.num_used_blocks == 0
