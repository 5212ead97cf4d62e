"""The self-speculative draft-model proposer: the target's first L layers, its final norm and LM head draft greedily.

The proposer against a dense oracle (Hugging Face's model cut to L layers, no cache) across steps that accept, reject
and drop sequences; the engine with it: greedy output unchanged and equal to Hugging Face's, drafts accepted, no
block leaked; a model whose last layer adds nothing accepts every draft; bad configurations name the key."""

import pytest
import torch

from grading.parity import assert_greedy_close, hf_greedy, hf_oracle
from grading.tiny_models import hf_model, tiny_checkpoint, tiny_model
from solutions import LLM, SamplingParams
from solutions.engine.arg_utils import EngineArgs
from solutions.exceptions import ParameterError
from solutions.model.loader import resolve_model
from solutions.spec_decode import Proposer
from solutions.spec_decode.draft_model import DraftModelProposer
from tests.test_spec_decode import COPYING, GREEDY, assert_no_block_leaks, core, tiny_prompts, tokens


def draft_config(num_draft_layers: int, k: int = 4) -> dict:
    return {"method": "draft_model", "num_speculative_tokens": k, "num_draft_layers": num_draft_layers}


def truncated_hf_greedy(folder, num_layers: int, token_ids: list[int], k: int) -> list[int]:
    """The oracle: Hugging Face's model of `folder` cut to its first `num_layers` layers, k greedy tokens, no cache."""
    model = hf_model(folder)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    out = list(token_ids)
    with torch.inference_mode():
        for _ in range(k):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(token_ids) :]


# --- the proposer -----------------------------------------------------------------------------------------------


def test_drafts_are_the_first_layers_greedy_tokens_across_accepts_rejects_and_drops():
    folder = tiny_checkpoint("llama-gqa")
    drafter: Proposer = DraftModelProposer(tiny_model("llama-gqa"), num_draft_layers=1, num_speculative_tokens=3)
    a, b = tiny_prompts(2, seed=3)
    drafts = drafter.propose_draft_token_ids([0, 1], [a, b])  # first sight: each prompt is caught up on
    assert drafts == [truncated_hf_greedy(folder, 1, a, 3), truncated_hf_greedy(folder, 1, b, 3)]
    assert drafter.num_catch_up_tokens == len(a) + len(b)
    # sequence 0 accepted its first draft then sampled another token; sequence 1 rejected every draft
    a2 = a + drafts[0][:1] + [(drafts[0][1] + 1) % 256]
    b2 = b + [(drafts[1][0] + 1) % 256]
    again = drafter.propose_draft_token_ids([0, 1], [a2, b2])
    assert again == [truncated_hf_greedy(folder, 1, a2, 3), truncated_hf_greedy(folder, 1, b2, 3)]
    assert drafter.num_catch_up_tokens == len(a) + len(b) + 2, "one new token each: the accepted draft's K/V is kept"
    assert drafter.caches[0].num_tokens == len(a2) + 2, "it holds the drafts it fed itself (k - 1)"
    drafter.propose_draft_token_ids([1], [b2 + again[1]])  # sequence 0 left the batch: its cache is dropped
    assert list(drafter.caches) == [1]
    assert drafter.propose_draft_token_ids([0], [a2]) == [again[0]], "a returning sequence rebuilds its cache"


def test_the_draft_shares_the_targets_weights():
    model = tiny_model("llama-gqa")
    drafter = DraftModelProposer(model, num_draft_layers=1, num_speculative_tokens=2)
    assert len(drafter.layers) == 1 and drafter.layers[0] is model.model.layers[0], "the same module, not a copy"


# --- in the engine ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias-mqa"])
@pytest.mark.parametrize(
    "engine_args",
    [
        dict(block_size=8, max_num_batched_tokens=24, long_prefill_token_threshold=8),  # chunks, trimmed drafts
        dict(block_size=4, num_kv_blocks=28),  # memory for part of the batch: preemption, the draft rebuilds
        dict(block_size=4, enable_prefix_caching=False),
    ],
    ids=["chunked-prefill", "preemption", "no-prefix-caching"],
)
def test_tiny_greedy_with_draft_model_equals_without_and_hugging_face(name, engine_args):
    folder = tiny_checkpoint(name)
    prompts = tiny_prompts(6, seed=len(name))
    llm = LLM(model=str(folder), speculative_config=draft_config(1), **engine_args)
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


def test_prefix_caching_shared_prompts_keep_the_greedy_tokens():
    """Prompts sharing a head: the target reads it from the prefix cache, the draft reads it itself."""
    folder = tiny_checkpoint("llama-gqa")
    head = tiny_prompts(1, seed=7)[0] * 2
    prompts = [head + tail for tail in tiny_prompts(4, seed=8)]
    llm = LLM(model=str(folder), block_size=4, speculative_config=draft_config(1))
    outputs = llm.generate(prompts, GREEDY)
    assert tokens(outputs) == tokens(LLM(model=str(folder), block_size=4).generate(prompts, GREEDY))
    assert core(llm).scheduler.kv_cache_manager.prefix_cache_stats.hits > 0, "the shared head was read from the cache"
    assert_no_block_leaks(llm)


def test_a_draft_of_all_but_an_idle_last_layer_accepts_every_draft(tmp_path):
    """Zero the last layer's output projections: it adds nothing to the residual stream, so the first L = N - 1
    layers compute the target's very logits and every draft is accepted."""
    model = hf_model(tiny_checkpoint("llama-gqa"))
    last = model.model.layers[-1]
    for linear in (last.self_attn.o_proj, last.mlp.down_proj):
        torch.nn.init.zeros_(linear.weight)
    model.save_pretrained(tmp_path)
    prompts = tiny_prompts(4, seed=5)
    llm = LLM(model=str(tmp_path), block_size=8, speculative_config=draft_config(1))
    outputs = llm.generate(prompts, GREEDY)
    assert tokens(outputs) == tokens(LLM(model=str(tmp_path), block_size=8).generate(prompts, GREEDY))
    stats = llm.llm_engine.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.num_steps < len(prompts) * 64 / 4, "about k + 1 tokens per step"
    assert_no_block_leaks(llm)


def test_smollm2_copying_prompt_with_all_but_the_last_layer_keeps_the_greedy_tokens_and_accepts():
    """SmolLM2's first 29 of 30 layers agree with it on only part of the tokens (nothing trained them to exit
    early, unlike LayerSkip): some drafts accepted, the tokens unchanged."""
    llm = LLM(model="smollm2-135m", max_num_seqs=1, max_model_len=256, speculative_config=draft_config(29, k=2))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    output = llm.generate(COPYING[1:], params)[0]
    folder = resolve_model("smollm2-135m")
    theirs = hf_greedy(folder, tuple(output.prompt_token_ids), 16)
    assert_greedy_close(output.outputs[0].token_ids, theirs, output.prompt_token_ids, hf_oracle(folder))
    stats = llm.llm_engine.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
    assert_no_block_leaks(llm)


# --- configuration ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(draft_config(2), prompt_lookup_max=3), "unknown keys ['prompt_lookup_max'] for method 'draft_model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "num_draft_layers": 2}, "unknown keys ['num_draft_layers']"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config['num_draft_layers'] must be"),
        (draft_config(0), "speculative_config['num_draft_layers'] must be an int >= 1, got 0"),
        (draft_config("2"), "speculative_config['num_draft_layers'] must be an int >= 1, got '2'"),
    ],
)
def test_a_bad_draft_model_config_names_the_key(config, message):
    with pytest.raises(ParameterError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        EngineArgs(speculative_config=config)
    assert e.value.parameter == "speculative_config"


def test_a_draft_model_with_tensor_parallelism_is_refused_naming_both_fields():
    """Rank 0 drafts alone: the draft's layers, its shards of the target's, would wait for the other ranks."""
    with pytest.raises(ParameterError, match="'draft_model' runs with tensor_parallel_size=1 only") as e:
        EngineArgs(speculative_config=draft_config(2), tensor_parallel_size=2)
    assert e.value.parameter == "speculative_config"


def test_a_draft_as_deep_as_the_model_is_refused_once_its_depth_is_known():
    folder = tiny_checkpoint("llama-gqa")  # 2 layers
    with pytest.raises(ParameterError, match=r"num_draft_layers'\] must be in \[1, 1\] \(the model has 2 layers\)"):
        EngineArgs(model=str(folder), speculative_config=draft_config(2)).create_engine_config()
    spec = EngineArgs(model=str(folder), speculative_config=draft_config(1)).create_engine_config().speculative_config
    assert (spec.method, spec.num_draft_layers, spec.prompt_lookup_max) == ("draft_model", 1, None)
