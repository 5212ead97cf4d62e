"""Structured output on SmolLM2: every constrained output conforms, whatever is sampled, and nothing else moves.

At temperature 1 over 50 seeds each, JSON outputs parse and validate against their schema (`jsonschema`), regex
outputs match, choice outputs are one of the choices; unconstrained requests sharing the batch get the very
tokens they get alone; n > 1, preemption by recompute, prefix-cache hits and streaming keep the outputs valid
(and, greedy, identical); a constraint that does not compile is a ValueError naming its field, with the requests
in flight undisturbed; a grammar that cannot finish within max_tokens ends with finish_reason "length".
One `LLM` (SmolLM2) serves the module; the server's side is in tests/test_serving.py.
"""

import collections
import functools
import json
import re

import jsonschema
import pytest
import torch

from benchmarks.structured_output import person_schema
from solutions import LLM, SamplingParams, StructuredOutputsParams
from solutions.engine.arg_utils import EngineArgs
from solutions.engine.llm_engine import LLMEngine
from solutions.exceptions import ParameterError
from solutions.outputs import FinishReason
from solutions.structured_output import ChoiceGrammar, StructuredOutputManager, TokenTexts
from solutions.structured_output.bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask,
    pack_token_bitmask,
    unpack_token_bitmask,
)

MODEL = "smollm2-135m"
SEEDS = range(50)
PERSON = person_schema()  # name, age, city, vegan: bounded, so a sampled output finishes well within max_tokens
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


def new_manager() -> StructuredOutputManager:
    """A manager for the module's tokenizer and model config, as the engine core makes its own."""
    model_config = llm().llm_engine.vllm_config.model_config
    return StructuredOutputManager(llm().tokenizer, model_config.vocab_size, model_config.eos_token_id)


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
