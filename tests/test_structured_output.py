"""Structured output on SmolLM2: every constrained output conforms, whatever is sampled, and nothing else moves.

At temperature 1 over 50 seeds each, JSON outputs parse and validate against their schema (`jsonschema`), regex
outputs match, choice outputs are one of the choices; unconstrained requests sharing the batch get the very
tokens they get alone; n > 1, preemption by recompute, prefix-cache hits and streaming keep the outputs valid
(and, greedy, identical); a constraint that does not compile is a ValueError naming its field, with the requests
in flight undisturbed; a grammar that cannot finish within max_tokens ends with finish_reason "length". JSON's
whitespace is bounded by default (a sample that wrote line breaks until max_tokens under llguidance's flexible
whitespace closes its object), none at all with `disable_any_whitespace`, and a request's `whitespace_pattern`.
One `LLM` (SmolLM2) serves the module; the server's side is in tests/test_serving.py.
"""

import argparse
import collections
import functools
import json
import re

import jsonschema
import pytest
import torch

from benchmarks.structured_output import VALIDITY_MAX_TOKENS, VALIDITY_PROMPT, VALIDITY_SCHEMAS, person_schema
from solutions import LLM, SamplingParams, StructuredOutputsParams
from solutions.engine.arg_utils import EngineArgs
from solutions.engine.llm_engine import LLMEngine
from solutions.exceptions import ParameterError
from solutions.outputs import FinishReason
from solutions.structured_output import ChoiceGrammar, StructuredOutputManager, TokenTexts
from solutions.structured_output.backend_guidance import BOUNDED_WHITESPACE
from solutions.structured_output.bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask,
    pack_token_bitmask,
    unpack_token_bitmask,
)

MODEL = "smollm2-135m"
SEEDS = range(50)
PERSON = person_schema()  # name, age, city, vegan: bounded, so a sampled output finishes well within max_tokens
OBJECT = VALIDITY_SCHEMAS["object"]  # name and age
FLEXIBLE_OBJECT = {**OBJECT, "x-guidance": {"whitespace_flexible": True}}  # any whitespace run, as before issue 52
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["Paris", "London", "Par", "New York City"]  # "Par" is a prefix of "Paris": the matcher must not stop early
JSON_PROMPT = "Describe a person as a JSON object:"
PHONE_PROMPT = "Write a US phone number:"
CHOICE_PROMPT = "The capital of France is"


@functools.cache
def llm() -> LLM:
    return LLM(MODEL, max_model_len=512, max_num_seqs=64)


def constrained(seed: int | None, max_tokens: int = 64, **constraint) -> SamplingParams:
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(
        temperature=temperature, seed=seed, max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


@functools.cache
def sweep() -> dict[str, list]:
    """150 constrained requests at temperature 1 (50 seeds of each kind) and two unconstrained ones, in one batch."""
    requests = (
        [(JSON_PROMPT, constrained(s, json=PERSON)) for s in SEEDS]
        + [(PHONE_PROMPT, constrained(s, regex=PHONE)) for s in SEEDS]
        + [(CHOICE_PROMPT, constrained(s, choice=CHOICES)) for s in SEEDS]
        + [(CHOICE_PROMPT, SamplingParams(temperature=0.0, max_tokens=24)),
           (JSON_PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=24))]
    )
    prompts, params = zip(*requests, strict=True)
    outputs = [o.outputs[0] for o in llm().generate(list(prompts), list(params), use_tqdm=False)]
    n = len(SEEDS)
    return {
        "json": outputs[:n], "regex": outputs[n : 2 * n], "choice": outputs[2 * n : 3 * n], "free": outputs[3 * n :]
    }


def test_every_json_output_parses_and_validates_against_its_schema():
    outputs = sweep()["json"]
    for output in outputs:
        assert output.finish_reason is FinishReason.STOP, (output.text, output.finish_reason)
        jsonschema.validate(json.loads(output.text), PERSON)
    assert len({o.text for o in outputs}) > 10, "temperature 1 over 50 seeds should give many different people"


def test_every_regex_output_matches():
    outputs = sweep()["regex"]
    for output in outputs:
        assert re.fullmatch(PHONE, output.text), output.text
        assert output.finish_reason is FinishReason.STOP
    assert len({o.text for o in outputs}) > 10


def test_every_choice_output_is_one_of_the_choices():
    outputs = sweep()["choice"]
    assert all(o.text in CHOICES for o in outputs), [o.text for o in outputs if o.text not in CHOICES]
    assert len({o.text for o in outputs}) >= 2, "50 samples at temperature 1 all gave the same choice"


def test_unconstrained_requests_in_the_same_batch_are_untouched():
    alone = llm().generate(
        [CHOICE_PROMPT, JSON_PROMPT],
        [SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=1.0, seed=3, max_tokens=24)],
        use_tqdm=False,
    )
    assert [o.token_ids for o in sweep()["free"]] == [a.outputs[0].token_ids for a in alone]


def test_n_samples_each_follow_their_own_grammar():
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=64,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    (output,) = llm().generate([JSON_PROMPT], params, use_tqdm=False)
    for sample in output.outputs:
        jsonschema.validate(json.loads(sample.text), PERSON)
    assert len({s.text for s in output.outputs}) > 1


def tight_engine(**overrides) -> LLMEngine:
    """An engine on the module's model with a small KV cache of 4-token blocks (so requests preempt each other)."""
    options = dict(block_size=4, num_kv_blocks=20, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512,
                   long_prefill_token_threshold=64) | overrides
    return LLMEngine.from_engine_args(EngineArgs(model=MODEL, **options))


def new_manager(disable_any_whitespace: bool = False) -> StructuredOutputManager:
    """A manager for the module's tokenizer and model config, as the engine core makes its own."""
    model_config = llm().llm_engine.vllm_config.model_config
    return StructuredOutputManager(
        llm().tokenizer, model_config.vocab_size, model_config.eos_token_id, disable_any_whitespace
    )


def stream(
    engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]
) -> dict[str, tuple[list[int], str, FinishReason]]:
    """Add the requests, step until the engine is idle, and join every request's DELTA outputs (those already in
    flight too): request id -> (tokens, text, finish reason)."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = collections.defaultdict(list)
    texts: dict[str, str] = collections.defaultdict(str)
    finish: dict[str, FinishReason] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            (completion,) = output.outputs
            tokens[output.request_id] += completion.token_ids
            texts[output.request_id] += completion.text
            if completion.finish_reason is not None:
                finish[output.request_id] = completion.finish_reason
    return {request_id: (tokens[request_id], texts[request_id], finish[request_id]) for request_id in finish}


def test_preemption_prefix_caching_and_streaming_keep_the_grammar_in_step():
    """Greedy JSON requests one by one on a roomy engine, then together on a tight one — they preempt each other
    and recompute, and their shared prompt hits the prefix cache — streamed as deltas: the same tokens, and the
    joined deltas are the valid JSON texts."""
    prompts = [JSON_PROMPT, JSON_PROMPT + " Alice.", JSON_PROMPT + " Bob.", JSON_PROMPT + " Carol."]
    requests = {f"r{i}": (prompt, constrained(None, json=PERSON)) for i, prompt in enumerate(prompts)}
    alone = {rid: llm().generate([prompt], params, use_tqdm=False)[0].outputs[0]
             for rid, (prompt, params) in requests.items()}
    engine = tight_engine()
    got = stream(engine, requests)
    scheduler = engine.engine_core.scheduler
    assert scheduler.num_preemptions > 0, "the tight cache should have forced preemptions"
    cached = sum(step.num_cached_tokens for step in engine.stats.steps)
    assert cached > 0, "the shared prompt should hit the prefix cache"
    for rid, (tokens, text, finish) in got.items():
        assert tokens == alone[rid].token_ids, rid
        assert text == alone[rid].text and finish is FinishReason.STOP
        jsonschema.validate(json.loads(text), PERSON)


def test_a_grammar_that_cannot_finish_ends_with_length():
    (output,) = llm().generate(["x"], constrained(0, max_tokens=6, regex=r"a{200}"), use_tqdm=False)
    assert output.outputs[0].finish_reason is FinishReason.LENGTH
    assert len(output.outputs[0].token_ids) == 6 and set(output.outputs[0].text) == {"a"}


BAD_CONSTRAINTS = [
    (dict(json={"type": "no-such-type"}), "json"),
    (dict(json="{not json"), "json"),
    (dict(regex="(unclosed"), "regex"),
    (dict(grammar="start: undefined_rule"), "grammar"),
    (dict(json=PERSON, whitespace_pattern="(unclosed"), "whitespace_pattern"),  # checked alone, named alone
]


def test_a_constraint_that_does_not_compile_is_refused_and_disturbs_nothing():
    engine = tight_engine(num_kv_blocks=64)
    engine.add_request("ok", JSON_PROMPT, constrained(None, json=PERSON))
    first = [t for output in engine.step() for t in output.outputs[0].token_ids]  # in flight: its prompt is in
    for constraint, field in BAD_CONSTRAINTS:
        with pytest.raises(ParameterError, match=rf"StructuredOutputsParams\.{field} is not valid") as refused:
            engine.add_request("bad", "x", SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)))
        assert refused.value.parameter == "structured_outputs"
        assert list(engine.engine_core.scheduler.requests) == ["ok"]
        assert list(engine.output_processor.request_states) == ["ok"]
    tokens, text, finish = stream(engine, {})["ok"]
    (alone,) = llm().generate([JSON_PROMPT], constrained(None, json=PERSON), use_tqdm=False)
    assert first + tokens == alone.outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of"),
        (dict(regex="a", choice=["a"]), "exactly one of"),
        (dict(choice=[]), "choice must be a non-empty list"),
        (dict(choice=["a", ""]), "choice must be a non-empty list"),
        (dict(json=3), "json must be a JSON schema"),
        (dict(regex=""), "regex must be a non-empty string"),
        (dict(json=PERSON, whitespace_pattern=3), "whitespace_pattern must be a non-empty string"),
        (dict(json_object=True, whitespace_pattern=""), "whitespace_pattern must be a non-empty string"),
        (dict(regex="a", whitespace_pattern=" "), "whitespace_pattern applies to json and json_object only"),
    ],
)
def test_structured_outputs_params_name_the_bad_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="structured_outputs must be None or a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": PERSON})


def test_equal_constraints_compile_once():
    manager = new_manager()
    first = manager.grammar_init(StructuredOutputsParams(json=dict(PERSON)), 2)
    second = manager.grammar_init(StructuredOutputsParams(json=json.dumps(PERSON)), 1)
    assert len(first) == 2 and first[0] is not first[1] and len(second) == 1
    info = manager._compile.cache_info()
    assert (info.misses, info.hits) == (1, 1), "the schema as a dict and as its JSON text are one constraint"


# --- whitespace in JSON --------------------------------------------------------------------------------------------


def gaps(text: str) -> list[str]:
    """The whitespace runs of a JSON text outside its strings."""
    return re.findall(r"\s+", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text))


def test_the_bounded_default_lets_a_sample_that_ran_out_on_whitespace_close_its_object():
    """Seed 11 on "JSON:": under flexible whitespace (the schema's own `x-guidance` asks for it, and wins over the
    default) it writes line breaks until max_tokens; under the default, the same sample closes a valid object."""
    params = [constrained(11, VALIDITY_MAX_TOKENS, json=schema) for schema in (FLEXIBLE_OBJECT, OBJECT)]
    ran_out, closed = (o.outputs[0] for o in llm().generate([VALIDITY_PROMPT] * 2, params, use_tqdm=False))
    assert ran_out.finish_reason is FinishReason.LENGTH and ran_out.text.endswith("\n" * 20), repr(ran_out.text)
    assert closed.finish_reason is FinishReason.STOP, repr(closed.text)
    jsonschema.validate(json.loads(closed.text), OBJECT)


def test_no_gap_of_a_sampled_json_output_holds_more_than_the_bounded_whitespace():
    for output in sweep()["json"]:
        assert all(re.fullmatch(BOUNDED_WHITESPACE, gap) for gap in gaps(output.text)), repr(output.text)


def accepts(manager: StructuredOutputManager, text: str, schema: dict = OBJECT, **options) -> bool:
    """Does the manager's grammar for `schema` take `text` whole, and then end?"""
    (grammar,) = manager.grammar_init(StructuredOutputsParams(json=schema, **options), 1)
    return grammar.accept_tokens(llm().tokenizer.encode(text)) and grammar.is_terminated()


def test_whitespace_the_request_then_the_schema_then_the_engine_decide():
    """By default a gap holds a line break and up to 8 spaces; `disable_any_whitespace`, nothing; a schema's own
    `x-guidance` wins over either, and a request's `whitespace_pattern` over all."""
    default, disabled = new_manager(), new_manager(disable_any_whitespace=True)
    compact, indented = '{"name":"Al","age":7}', '{\n  "name": "Al",\n  "age": 7\n}'
    assert accepts(default, compact) and accepts(default, indented)
    assert not accepts(default, "{\n\n" + compact[1:]) and not accepts(default, "{" + " " * 9 + compact[1:])
    assert accepts(disabled, compact) and not accepts(disabled, indented)
    for manager in (default, disabled):  # the schema's own options over the engine's, the request's over both
        assert accepts(manager, "{" + "\n" * 30 + compact[1:], FLEXIBLE_OBJECT)
        tabbed = '{\t"name":\t"Al",\t"age":7}'
        assert accepts(manager, tabbed, whitespace_pattern=r"\t?") and not accepts(manager, tabbed)
        assert not accepts(manager, indented, FLEXIBLE_OBJECT, whitespace_pattern=r"\t?")


def test_disable_any_whitespace_leaves_none_between_tokens():
    engine = tight_engine(num_kv_blocks=128, max_num_seqs=8, disable_any_whitespace=True)
    requests = {f"s{seed}": (VALIDITY_PROMPT, constrained(seed, VALIDITY_MAX_TOKENS, json=OBJECT)) for seed in range(8)}
    for _, text, finish in stream(engine, requests).values():
        assert finish is FinishReason.STOP and gaps(text) == [], repr(text)
        jsonschema.validate(json.loads(text), OBJECT)


def test_disable_any_whitespace_is_an_engine_option_and_a_flag_named_when_bad():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--disable-any-whitespace"])).disable_any_whitespace is True
    config = EngineArgs(model=MODEL, disable_any_whitespace=True).create_engine_config()
    assert config.structured_outputs_config.disable_any_whitespace is True
    with pytest.raises(ParameterError, match="disable_any_whitespace must be True or False, got 'yes'") as refused:
        EngineArgs(model=MODEL, disable_any_whitespace="yes")
    assert refused.value.parameter == "disable_any_whitespace"


# --- the pieces, exactly --------------------------------------------------------------------------------------------


def test_bitmask_pack_unpack_and_apply_agree_with_a_bool_mask():
    generator = torch.Generator().manual_seed(0)
    vocab_size = 77  # not a multiple of 32: the last word's high bits are past the vocabulary
    allowed = torch.rand(3, vocab_size, generator=generator) < 0.3
    allowed[:, 31] = True  # bit 31 is the sign bit of an int32 word
    bitmask = torch.stack([pack_token_bitmask(row.nonzero().flatten().tolist(), 3) for row in allowed])
    assert torch.equal(unpack_token_bitmask(bitmask, vocab_size), allowed)
    logits = torch.randn(3, vocab_size, generator=generator)
    masked = apply_token_bitmask(logits, bitmask)
    assert torch.equal(masked[allowed], logits[allowed]) and torch.isneginf(masked[~allowed]).all()
    all_allowed = unpack_token_bitmask(allocate_token_bitmask(2, vocab_size), vocab_size)
    assert torch.equal(all_allowed, torch.ones(2, vocab_size, dtype=torch.bool))


def test_the_guidance_mask_allows_exactly_what_the_schema_allows_next():
    manager = new_manager()
    (grammar,) = manager.grammar_init(StructuredOutputsParams(json=PERSON), 1)
    bitmask = allocate_token_bitmask(1, manager.vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    allowed = unpack_token_bitmask(bitmask, manager.vocab_size)[0].nonzero().flatten().tolist()
    texts = llm().tokenizer.batch_decode([[t] for t in allowed])
    assert allowed and all('{"name":"'.startswith(t) or t.startswith('{"name":"') for t in texts), texts[:20]
    assert grammar.accept_tokens(llm().tokenizer.encode('{"name":"Al","age":7,"city":"Tokyo","vegan":true}'))
    assert grammar.is_terminated()


def test_the_choice_matcher_follows_text_not_one_tokenisation():
    tokens = TokenTexts([b"", b"P", b"Par", b"is", b"Paris", b"L", b"ondon", b"x"], {}, eos_token_id=0)
    tokens.ids_by_text.update({t: [i] for i, t in enumerate(tokens.texts) if t})
    grammar = ChoiceGrammar(["Paris", "Par", "London"], tokens)
    assert grammar.allowed_token_ids() == [1, 2, 4, 5]
    assert grammar.accept_tokens([2]) and not grammar.is_terminated()  # "Par" is a choice, "Paris" extends it
    assert grammar.allowed_token_ids() == [0, 3]  # "is", or the end of the sequence
    assert grammar.accept_tokens([3]) and grammar.is_terminated() and grammar.text == b"Paris"
    assert not ChoiceGrammar(["Paris"], tokens).accept_tokens([7])
