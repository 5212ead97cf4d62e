"""Speculative decoding (n-gram drafts) in the engine: greedy output unchanged in every configuration the engine
runs, the scheduler's admission of drafts (budget, max_model_len) and its hand-back of rejected ones (rollback,
blocks kept, prefix-cache hashes of verified tokens only), stops inside an accepted run, the target's logprobs,
acceptance counts, and the refused combinations."""

import argparse

import pytest
import torch

from grading.parity import assert_greedy_close, hf_greedy, hf_oracle
from grading.tiny_models import tiny_checkpoint
from solutions import LLM, FinishReason, SamplingParams
from solutions.config import SpeculativeConfig
from solutions.core.block_hash import extend_block_hashes
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sched.output import DraftTokenIds, ModelRunnerOutput
from solutions.core.sched.scheduler import Scheduler
from solutions.core.sequence import Sequence
from solutions.engine.arg_utils import EngineArgs
from solutions.exceptions import ParameterError
from solutions.model.loader import resolve_model
from solutions.sampling_params import StructuredOutputsParams
from solutions.utils.math_utils import cdiv

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
PASSAGE = (
    "Paged attention stores the keys and values of every sequence in fixed-size blocks, so memory is allocated "
    "on demand and shared between sequences."
)
COPYING = [  # prompts whose continuation copies earlier text: the n-gram drafts are accepted
    f"Repeat the text exactly.\nText: {PASSAGE}\nRepeated: {PASSAGE}\nText: {PASSAGE}\nRepeated:",
    f"Copy: {PASSAGE} {PASSAGE[:60]}",
]


def core(llm: LLM):
    return llm.llm_engine.engine_core  # the client: the core's parts are in this process


def tiny_prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (count,), generator=g).tolist()
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def verified_block_hashes(llm_outputs, block_size: int) -> set[bytes]:
    """The hashes of every full block of every finished sequence's own tokens (prompt then output)."""
    hashes: set[bytes] = set()
    for output in llm_outputs:
        for completion in output.outputs:
            token_ids = output.prompt_token_ids + completion.token_ids
            chain: list[bytes] = []
            extend_block_hashes(chain, token_ids, len(token_ids), block_size)
            hashes.update(chain)
    return hashes


def assert_no_block_leaks(llm: LLM) -> None:
    manager = core(llm).scheduler.kv_cache_manager
    assert manager.num_used_blocks == 0, "every block is freed when the requests finish"
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)


# --- greedy: speculation changes no token --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias-mqa"])
@pytest.mark.parametrize(
    "engine_args",
    [
        dict(block_size=16),
        dict(block_size=4, max_num_seqs=2),  # many small blocks: drafts cross block boundaries
        dict(block_size=8, max_num_batched_tokens=24, long_prefill_token_threshold=8),  # chunks, trimmed drafts
        dict(block_size=4, num_kv_blocks=28),  # memory for part of the batch: preemption drops drafts
        dict(block_size=4, enable_prefix_caching=False),
    ],
    ids=["one-batch", "small-blocks", "chunked-prefill", "preemption", "no-prefix-caching"],
)
def test_tiny_greedy_with_speculation_equals_without_and_hugging_face(name, engine_args):
    folder = tiny_checkpoint(name)
    prompts = tiny_prompts(6, seed=len(name))
    llm = LLM(model=str(folder), speculative_config=NGRAM, **engine_args)
    outputs = llm.generate(prompts, GREEDY)
    assert tokens(outputs) == tokens(LLM(model=str(folder), **engine_args).generate(prompts, GREEDY))
    for prompt, output in zip(prompts, outputs, strict=True):
        theirs = hf_greedy(folder, tuple(prompt), 64)
        assert_greedy_close(output.outputs[0].token_ids, theirs, prompt, hf_oracle(folder))
    stats = llm.llm_engine.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0, "drafts were proposed, some accepted, some not"
    if "num_kv_blocks" in engine_args:
        assert sum(s.num_preemptions for s in stats.steps) > 0, "the tight pool preempts"
    assert_no_block_leaks(llm)


@pytest.mark.parametrize(
    "engine_args", [dict(attention_backend="inductor"), dict(attention_backend="triton")], ids=["inductor", "triton"]
)
def test_every_attention_backend_verifies_several_tokens_per_sequence(engine_args):
    """The drafts go through each backend's multi-token path (a chunk with earlier context): same tokens."""
    folder = tiny_checkpoint("llama-gqa")
    prompts = tiny_prompts(4, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(model=str(folder), block_size=8, speculative_config=NGRAM, **engine_args)
    plain = LLM(model=str(folder), block_size=8)
    assert tokens(llm.generate(prompts, params)) == tokens(plain.generate(prompts, params))
    assert llm.llm_engine.stats.num_draft_tokens > 0
    assert_no_block_leaks(llm)


@pytest.fixture(scope="module")
def smollm2_spec():
    return LLM(model="smollm2-135m", max_num_seqs=4, max_model_len=512, speculative_config=NGRAM)


def test_smollm2_copying_prompt_accepts_drafts_and_keeps_the_greedy_tokens(smollm2_spec):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    stats = smollm2_spec.llm_engine.stats
    steps, drafts, accepted = stats.num_steps, stats.num_draft_tokens, stats.num_accepted_tokens
    outputs = smollm2_spec.generate(COPYING, params)
    folder = resolve_model("smollm2-135m")
    for output in outputs:
        prompt_ids = output.prompt_token_ids
        theirs = hf_greedy(folder, tuple(prompt_ids), 40)
        assert_greedy_close(output.outputs[0].token_ids, theirs, prompt_ids, hf_oracle(folder))
    drafts, accepted = stats.num_draft_tokens - drafts, stats.num_accepted_tokens - accepted
    assert accepted > drafts // 2 > 0, f"copying text: most drafts are accepted ({accepted} of {drafts})"
    assert stats.num_steps - steps < 40, "accepted drafts: fewer steps than tokens"
    assert_no_block_leaks(smollm2_spec)


def test_stop_token_and_max_tokens_inside_an_accepted_run_cut_it_there(smollm2_spec):
    plain = LLM(model="smollm2-135m", max_num_seqs=4, max_model_len=512)
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    reference = plain.generate(COPYING[:1], base)[0].outputs[0].token_ids
    stop_id = reference[12]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
    ):
        (want,) = plain.generate(COPYING[:1], params)
        (ours,) = smollm2_spec.generate(COPYING[:1], params)
        assert ours.outputs[0].token_ids == want.outputs[0].token_ids
        assert (ours.outputs[0].finish_reason, ours.outputs[0].stop_reason) == (
            want.outputs[0].finish_reason, want.outputs[0].stop_reason
        )
    assert want.outputs[0].finish_reason == FinishReason.LENGTH and len(want.outputs[0].token_ids) == 13
    assert_no_block_leaks(smollm2_spec)


def test_logprobs_are_the_targets(smollm2_spec):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    plain = LLM(model="smollm2-135m", max_num_seqs=4, max_model_len=512)
    (want,) = plain.generate(COPYING[:1], params)
    accepted = smollm2_spec.llm_engine.stats.num_accepted_tokens
    (ours,) = smollm2_spec.generate(COPYING[:1], params)
    assert smollm2_spec.llm_engine.stats.num_accepted_tokens > accepted, "some tokens came from accepted drafts"
    assert ours.outputs[0].token_ids == want.outputs[0].token_ids
    ours_lp, want_lp = ours.outputs[0].logprobs, want.outputs[0].logprobs
    assert len(ours_lp) == len(want_lp) == 24
    for token_id, a, b in zip(want.outputs[0].token_ids, ours_lp, want_lp, strict=True):
        assert sorted(a) == sorted(b) and token_id in a
        for t in b:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-3)
            assert a[t].rank == b[t].rank


# --- the hand-back, step by step --------------------------------------------------------------------------------


def scheduler_with_drafts(
    prompt: list[int], drafts: list[int], params: SamplingParams, budget: int = 64, block_size: int = 4,
    max_model_len: int = 128,
):
    """A scheduler whose one sequence has computed `prompt`, sampled token 99 and was proposed `drafts`, then has
    been scheduled again with a token budget of `budget`: (scheduler, sequence, that step's SchedulerOutput)."""
    manager = KVCacheManager(num_blocks=16, block_size=block_size, enable_prefix_caching=True)
    scheduler = Scheduler(
        manager, max_num_seqs=4, max_num_batched_tokens=64, long_prefill_token_threshold=64,
        max_model_len=max_model_len,
    )
    seq = Sequence(0, prompt)
    seq.request_id, seq.sampling_params = "r", params
    scheduler.add_request(seq)
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput([0], [[99]], [None]))
    scheduler.update_draft_token_ids(DraftTokenIds([0], [drafts]))  # the engine core's post_step
    scheduler.max_num_batched_tokens = budget
    return scheduler, seq, scheduler.schedule()


def test_a_step_with_drafts_schedules_them_with_slots_and_hashes_only_verified_blocks():
    scheduler, seq, out = scheduler_with_drafts([1, 2, 3, 4, 5], [6, 7, 8, 9], SamplingParams(max_tokens=20))
    assert out.num_scheduled_tokens == [5] and out.scheduled_spec_decode_tokens == {0: [6, 7, 8, 9]}
    assert out.num_decode_tokens == 5 and out.num_prefill_tokens == 0
    assert len(seq.block_table) == cdiv(6 + 4, 4), "slots for the newest token and the 4 drafts"
    pool = scheduler.kv_cache_manager.block_pool
    assert [pool.blocks[b].block_hash is not None for b in seq.block_table] == [True, False, False], (
        "block 1 would hold drafts: not hashed before they are verified"
    )


@pytest.mark.parametrize("num_accepted", [0, 1, 2, 4])
def test_rejected_drafts_are_handed_back(num_accepted):
    drafts = [6, 7, 8, 9]
    scheduler, seq, out = scheduler_with_drafts([1, 2, 3, 4, 5], drafts, SamplingParams(max_tokens=20))
    sampled = drafts[:num_accepted] + [50]
    outputs = scheduler.update_from_output(out, ModelRunnerOutput([0], [sampled], [None]))
    assert outputs.outputs[0].new_token_ids == sampled
    assert seq.token_ids == [1, 2, 3, 4, 5, 99, *sampled]
    assert seq.num_computed_tokens == seq.num_tokens - 1, "rolled back by the rejected drafts, once"
    assert len(seq.block_table) == cdiv(6 + 4, 4), "blocks that held only rejected drafts stay for the next drafts"
    assert scheduler.kv_cache_manager.num_used_blocks == len(seq.block_table)
    pool = scheduler.kv_cache_manager.block_pool
    hashes: list[bytes] = []
    extend_block_hashes(hashes, seq.token_ids, seq.num_computed_tokens, 4)
    assert [pool.blocks[b].block_hash for b in seq.block_table] == (hashes + [None] * 3)[: len(seq.block_table)], (
        "exactly the blocks full of verified, computed tokens are hashed"
    )
    stats = outputs.scheduler_stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (4, num_accepted)
    assert seq.spec_token_ids == []
    nxt = scheduler.schedule()
    assert nxt.num_computed_tokens == [seq.num_tokens - 1] and nxt.num_scheduled_tokens == [1]


def test_a_stop_token_inside_the_accepted_run_ends_it_and_frees_everything():
    scheduler, seq, out = scheduler_with_drafts(
        [1, 2, 3, 4, 5], [6, 7, 8, 9], SamplingParams(max_tokens=20, stop_token_ids=[7])
    )
    outputs = scheduler.update_from_output(out, ModelRunnerOutput([0], [[6, 7, 8, 50]], [None]))
    (output,) = outputs.outputs
    assert output.new_token_ids == [6, 7] and output.finish_reason == FinishReason.STOP and output.stop_reason == 7
    assert seq.num_computed_tokens == seq.num_tokens == 8, "the stop token was a draft: its K/V is computed"
    manager = scheduler.kv_cache_manager
    assert manager.num_used_blocks == 0
    cached = set(manager.block_pool.cached_block_hash_to_block)
    hashes: list[bytes] = []
    extend_block_hashes(hashes, seq.token_ids, seq.num_tokens, 4)
    assert cached == set(hashes), "both blocks, the second ending with the stop token, and no token it did not keep"


def test_drafts_are_capped_by_max_model_len_and_the_budget():
    _, _, out = scheduler_with_drafts([1, 2, 3, 4, 5], [6, 7, 8, 9], SamplingParams(max_tokens=20), max_model_len=9)
    assert out.scheduled_spec_decode_tokens == {0: [6, 7]}, "6 tokens, max_model_len 9: room for 2 drafts + one"
    _, _, out = scheduler_with_drafts([1, 2, 3, 4, 5], [6, 7, 8, 9], SamplingParams(max_tokens=3))
    assert out.scheduled_spec_decode_tokens == {0: [6, 7, 8, 9]}, "max_tokens does not cap them (as in vLLM)"
    _, seq, out = scheduler_with_drafts([1, 2, 3, 4, 5], [6, 7, 8, 9], SamplingParams(max_tokens=20), budget=3)
    assert out.num_scheduled_tokens == [3] and out.scheduled_spec_decode_tokens == {0: [6, 7]}
    assert seq.num_computed_tokens == 6 + 2 and len(seq.block_table) == cdiv(6 + 2, 4)


# --- engine-level invariants -------------------------------------------------------------------------------------


def test_no_proposal_before_the_prompt_is_in_and_no_leak_after_many_rejections():
    folder = tiny_checkpoint("llama-gqa")
    llm = LLM(model=str(folder), block_size=4, num_kv_blocks=40, max_num_batched_tokens=16,
              long_prefill_token_threshold=6, speculative_config=NGRAM)
    engine = llm.llm_engine
    for i, prompt in enumerate(tiny_prompts(8, seed=3)):
        engine.add_request(str(i), prompt, GREEDY)
    scheduler = core(llm).scheduler
    while engine.has_unfinished_requests():
        engine.step()
        for seq in scheduler.running:
            assert seq.num_computed_tokens <= seq.num_tokens
            if seq.num_computed_tokens < seq.num_tokens - 1:
                assert seq.spec_token_ids == [], "no drafts while the prompt (or a recompute) is still going in"
            else:
                k = NGRAM["num_speculative_tokens"]  # blocks of rejected drafts stay for the next ones
                assert cdiv(seq.num_computed_tokens, 4) <= len(seq.block_table) <= cdiv(seq.num_tokens - 1 + k, 4)
    stats = engine.stats
    assert stats.num_draft_tokens - stats.num_accepted_tokens > 500, "many rejections"
    assert sum(s.num_preemptions for s in stats.steps) > 0
    assert_no_block_leaks(llm)


def test_prefix_caching_on_equals_off_and_caches_only_verified_tokens():
    folder = tiny_checkpoint("qwen2-bias-mqa")
    prompts = tiny_prompts(6, seed=7)
    on = LLM(model=str(folder), block_size=4, speculative_config=NGRAM)
    off = LLM(model=str(folder), block_size=4, speculative_config=NGRAM, enable_prefix_caching=False)
    cold = on.generate(prompts, GREEDY)
    assert tokens(cold) == tokens(off.generate(prompts, GREEDY))
    cached = set(core(on).scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block)
    assert cached and cached <= verified_block_hashes(cold, 4), "a cached block holds only verified tokens"
    warm_prompts = [p + o.outputs[0].token_ids[:30] for p, o in zip(prompts, cold, strict=True)]
    manager = core(on).scheduler.kv_cache_manager
    hits = manager.prefix_cache_stats.hits
    warm = on.generate(warm_prompts, GREEDY)
    assert manager.prefix_cache_stats.hits > hits, "the warm prompts hit the blocks the first run verified"
    assert tokens(warm) == tokens(off.generate(warm_prompts, GREEDY))
    assert set(manager.block_pool.cached_block_hash_to_block) <= verified_block_hashes(cold + warm, 4)
    assert_no_block_leaks(on)


def test_n_greater_than_one_greedy_samples_all_equal_hugging_face_and_seeded_ones_reproduce():
    folder = tiny_checkpoint("llama-gqa")
    prompts = tiny_prompts(3, seed=11)
    llm = LLM(model=str(folder), block_size=4, speculative_config=NGRAM)
    for prompt, output in zip(prompts, llm.generate(prompts, SamplingParams(n=3, temperature=0.0, max_tokens=64,
                                                                             ignore_eos=True)), strict=True):
        for completion in output.outputs:
            assert_greedy_close(completion.token_ids, hf_greedy(folder, tuple(prompt), 64), prompt, hf_oracle(folder))
    seeded = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=48, ignore_eos=True)
    first = tokens(llm.generate(prompts, seeded))
    again = tokens(LLM(model=str(folder), block_size=16, speculative_config=NGRAM).generate(prompts, seeded))
    assert first == again, "seeded sampling with speculation reproduces in another engine"
    assert_no_block_leaks(llm)


def test_samples_forked_beside_a_sequence_with_drafts_match_hugging_face():
    """An n > 1 request whose prompt completes in a step where another sequence verifies drafts: its samples share
    their parent's last row, which sits among the other sequence's draft rows."""
    folder = tiny_checkpoint("llama-gqa")
    first, second = tiny_prompts(2, seed=5)
    llm = LLM(model=str(folder), block_size=4, speculative_config=NGRAM)
    engine, scheduler = llm.llm_engine, core(llm).scheduler
    generated: dict[tuple[str, int], list[int]] = {}  # (request id, sample) -> its tokens, from the steps' deltas

    def step() -> None:
        for output in engine.step():
            for completion in output.outputs:
                generated.setdefault((output.request_id, completion.index), []).extend(completion.token_ids)

    engine.add_request("a", first, GREEDY)
    while not any(seq.spec_token_ids for seq in scheduler.running):
        step()
    engine.add_request("b", second, SamplingParams(n=3, temperature=0.0, max_tokens=64, ignore_eos=True))
    while engine.has_unfinished_requests():
        step()
    assert sorted(generated) == [("a", 0), ("b", 0), ("b", 1), ("b", 2)]
    for (request_id, _), token_ids in generated.items():
        prompt = first if request_id == "a" else second
        assert_greedy_close(token_ids, hf_greedy(folder, tuple(prompt), 64), prompt, hf_oracle(folder))
    assert_no_block_leaks(llm)


# --- configuration ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2},
         "speculative_config['method'] must be one of ('ngram', 'draft_model')"),
        ({"method": "ngram"}, "speculative_config['num_speculative_tokens'] must be an int >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config['num_speculative_tokens']"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "speculative_config['prompt_lookup_min'] must be at most prompt_lookup_max=2"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown keys ['draft_model']"),
        ("ngram", "speculative_config must be a dict"),
    ],
)
def test_a_bad_speculative_config_names_the_key(config, message):
    with pytest.raises(ParameterError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")) as e:
        EngineArgs(speculative_config=config)
    assert e.value.parameter == "speculative_config"


@pytest.mark.parametrize(
    "fields, message",
    [
        (("ngram", 4, 3, 2), "speculative_config['prompt_lookup_min'] must be at most prompt_lookup_max=2, got 3"),
        (("ngram", 4, 0, 2), "speculative_config['prompt_lookup_min'] must be an int >= 1, got 0"),
        (("ngram", 4, 1.5, 2), "speculative_config['prompt_lookup_min'] must be an int >= 1, got 1.5"),
        (("ngram", 4, True, 2), "speculative_config['prompt_lookup_min'] must be an int >= 1, got True"),
        (("ngram", 4, 1, None), "speculative_config['prompt_lookup_max'] must be an int >= 1, got None"),
        (("ngram", 0, 1, 2), "speculative_config['num_speculative_tokens'] must be an int >= 1, got 0"),
        (("draft_model", 4, None, None, 0), "speculative_config['num_draft_layers'] must be an int >= 1, got 0"),
        (("draft_model", 4, None, 3, 1), "unknown keys ['prompt_lookup_max'] for method 'draft_model'"),
        (("eagle", 4), "speculative_config['method'] must be one of ('ngram', 'draft_model'), got 'eagle'"),
    ],
)
def test_speculative_config_checks_its_own_values_naming_the_key(fields, message):
    """The rules live in `SpeculativeConfig`: made directly, without `EngineArgs`, a bad value is refused the same
    (the proposers take their values as they are)."""
    with pytest.raises(ParameterError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")) as e:
        SpeculativeConfig(*fields)
    assert e.value.parameter == "speculative_config"


def test_a_draft_as_deep_as_the_target_is_refused_by_the_config():
    options = {"method": "draft_model", "num_speculative_tokens": 2, "num_draft_layers": 2}
    with pytest.raises(ParameterError, match=r"num_draft_layers'\] must be in \[1, 1\] \(the model has 2 layers\)"):
        SpeculativeConfig.from_options(options, num_hidden_layers=2)
    assert SpeculativeConfig.from_options(options, num_hidden_layers=3).num_draft_layers == 2


def test_speculative_config_defaults_and_the_command_line_flag():
    args = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    spec = args._speculative_config()
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4, 4)
    assert EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 1})._speculative_config(
    ).prompt_lookup_min == 5, "vLLM's default when neither bound is given"
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    parsed = EngineArgs.from_cli_args(parser.parse_args(args.to_cli_args()))
    assert parsed.speculative_config == args.speculative_config
    assert EngineArgs().create_engine_config().speculative_config is None


@pytest.mark.parametrize(
    "options, other",
    [(dict(kv_reservation="max"), "kv_reservation='max'")],
)
def test_unsupported_combinations_name_both_fields(options, other):
    with pytest.raises(ParameterError, match=other) as e:
        EngineArgs(speculative_config=NGRAM, **options)
    assert e.value.parameter == "speculative_config"


def test_structured_outputs_are_refused_naming_both_fields(smollm2_spec):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    with pytest.raises(ParameterError, match="speculative_config") as e:
        smollm2_spec.generate(["Is it?"], params)
    assert e.value.parameter == "structured_outputs"
