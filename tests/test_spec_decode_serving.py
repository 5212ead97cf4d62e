"""Speculative decoding through the OpenAI-compatible server: `python -m solutions.serve --speculative-config
'{"method": "ngram", ...}'` (vLLM's flag) streams, for completions and chat, the greedy text without it (an
accepted run arrives in one step, so a delta may carry several tokens); `/metrics` has vLLM's
`vllm:spec_decode_*` counters, only with speculation on; a bad `--speculative-config` stops the server at start-up
with an error naming the flag. The offline engine's stats sum the same counts and say vLLM's acceptance figures.

One SmolLM2 server with n-gram drafts serves the module (started from the command line, in its own process); the
text without drafts is the offline engine's (tests/test_serving.py checks that a plain server streams it, and that
its /metrics has no `vllm:spec_decode_*` counter). The prompts ask for text to be copied, so the drafts are mostly
accepted.
"""

import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from solutions import LLM, SamplingParams
from solutions.entrypoints.openai.api_server import serve_in_background
from solutions.metrics.stats import EngineStats, SchedulerStats
from solutions.serve import main as serve_main

MODEL = "smollm2-135m"
MAX_TOKENS = 32
NUM_SPECULATIVE_TOKENS = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS, "prompt_lookup_max": 3}
SERVER = dict(max_model_len=512, max_num_seqs=4)
PASSAGE = (
    "Paged attention stores the keys and values of every sequence in fixed-size blocks, so memory is allocated "
    "on demand and shared between sequences."
)
COPYING_PROMPT = f"Repeat the text exactly.\nText: {PASSAGE}\nRepeated: {PASSAGE}\nText: {PASSAGE}\nRepeated:"
COPYING_CHAT = [{"role": "user", "content": f"Repeat this sentence exactly, word for word: {PASSAGE}"}]
SPEC_DECODE_COUNTERS = (
    "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)


@pytest.fixture(scope="module")
def speculating():
    """The server as the command line starts it: `python -m solutions.serve ... --speculative-config '{...}'`."""
    with serve_in_background(MODEL, in_subprocess=True, speculative_config=NGRAM, **SERVER) as running:
        yield running


@pytest.fixture(scope="module")
def plain() -> dict[str, tuple[str, str, int]]:
    """The offline engine's greedy answers without drafts: "completion" and "chat" → (text, finish reason,
    tokens)."""
    llm = LLM(MODEL, **SERVER)
    chat_prompt = llm.tokenizer.apply_chat_template(COPYING_CHAT, tokenize=False, add_generation_prompt=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([COPYING_PROMPT, chat_prompt], greedy, use_tqdm=False)
    answers = [(o.outputs[0].text, o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in outputs]
    return dict(zip(("completion", "chat"), answers, strict=True))


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", max_retries=0, timeout=120)


def spec_decode_metrics(server) -> dict[tuple[str, str | None], float]:
    """The `vllm:spec_decode_*` counters on /metrics, parsed with Prometheus's own parser: (sample name, its
    `position` label or None) → value."""
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, sample.labels.get("position")): sample.value
        for family in text_string_to_metric_families(text) if family.name.startswith("vllm:spec_decode")
        for sample in family.samples if sample.name.endswith("_total")
    }


def accepted_tokens(server) -> float:
    return spec_decode_metrics(server)[("vllm:spec_decode_num_accepted_tokens_total", None)]


def stream_completion(server) -> tuple[str, str, int]:
    """COPYING_PROMPT streamed, greedy: (the text, the finish reason, the completion tokens in the usage)."""
    *chunks, usage = client(server).completions.create(
        model=MODEL, prompt=COPYING_PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    text = "".join(chunk.choices[0].text for chunk in chunks)
    return text, chunks[-1].choices[0].finish_reason, usage.usage.completion_tokens


def stream_chat(server) -> tuple[str, str]:
    chunks = list(client(server).chat.completions.create(
        model=MODEL, messages=COPYING_CHAT, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True,
    ))
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks), chunks[-1].choices[0].finish_reason


def test_streamed_completion_with_drafts_is_the_greedy_text_without(speculating, plain):
    accepted = accepted_tokens(speculating)
    ours = stream_completion(speculating)
    assert ours == plain["completion"]
    assert ours[1:] == ("length", MAX_TOKENS)
    assert accepted_tokens(speculating) > accepted, "the stream was speculated: drafts were accepted"


def test_streamed_chat_with_drafts_is_the_greedy_text_without(speculating, plain):
    accepted = accepted_tokens(speculating)
    ours = stream_chat(speculating)
    assert ours == plain["chat"][:2]
    assert PASSAGE[:20] in ours[0], "the model copies the sentence (so drafts can be accepted)"
    assert accepted_tokens(speculating) > accepted


def test_metrics_count_drafts_and_accepted_tokens_per_position(speculating):
    stream_completion(speculating)
    values = spec_decode_metrics(speculating)
    num_drafts = values[("vllm:spec_decode_num_drafts_total", None)]
    num_draft_tokens = values[("vllm:spec_decode_num_draft_tokens_total", None)]
    num_accepted = values[("vllm:spec_decode_num_accepted_tokens_total", None)]
    per_pos = [values[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(j))]
               for j in range(NUM_SPECULATIVE_TOKENS)]
    assert len(values) == 3 + NUM_SPECULATIVE_TOKENS, "one per-position counter per draft position"
    assert 0 < num_drafts <= num_draft_tokens <= NUM_SPECULATIVE_TOKENS * num_drafts
    assert 0 < num_accepted <= num_draft_tokens
    assert sum(per_pos) == num_accepted, "every accepted token has one position"
    assert per_pos == sorted(per_pos, reverse=True), "a draft is accepted up to its first rejection"
    assert num_drafts >= per_pos[0]


def test_engine_stats_add_drafts_per_position_and_say_vllms_acceptance_figures():
    """`LLMEngine.stats` (what `python -m solutions` prints): per-position counts added across steps whose
    longest draft differs, and vLLM's summary — mean acceptance length counts the bonus token."""
    stats = EngineStats()
    assert stats.spec_decoding_summary() is None, "nothing drafted: nothing to say"
    for num_drafts, num_draft_tokens, per_pos in ((2, 5, [2, 1, 1]), (1, 4, [1, 1, 0, 0])):
        step = SchedulerStats(1, 0, 1, 0.1, 0, 0, num_drafts=num_drafts, num_draft_tokens=num_draft_tokens,
                              num_accepted_tokens=sum(per_pos), seconds={"forward": 0.01})
        step.num_accepted_tokens_per_pos = per_pos
        stats.record(step)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 6)
    assert stats.num_accepted_tokens_per_pos == [3, 2, 1, 0]
    assert stats.spec_decoding_summary() == (
        "mean acceptance length 3.00, acceptance rate 66.7% (6 of 9 draft tokens), per position 1.00, 0.67, 0.33, 0.00"
    )


@pytest.mark.parametrize("value, says", [
    ('{"method": "ngram", "num_speculative_token": 4}', "unknown keys ['num_speculative_token']"),
    ("{method: ngram}", "invalid"),  # not JSON
])
def test_a_bad_speculative_config_stops_the_server_at_start_up_naming_the_flag(value, says, capsys):
    """`python -m solutions.serve`'s own `main`, called here: it exits before loading a model."""
    with pytest.raises(SystemExit) as stopped:
        serve_main(["--port", "0", "--speculative-config", value])
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2, stderr[-2000:]  # argparse's status for a bad command line
    error = stderr.strip().splitlines()[-1]
    assert error.startswith("python -m solutions.serve: error:") and "--speculative-config" in error
    assert says in error
