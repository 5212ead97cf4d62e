"""The OpenAI-compatible server, live on 127.0.0.1, driven by the real `openai` client: completions and chat,
whole and streamed, token for token what `LLM` generates offline; 32 streaming clients at once; clients that
hang up mid-request (their blocks come back); bad requests refused with OpenAI's error shape, naming the field,
while the server keeps serving; `/v1/models`, `/health`, `/metrics`. A request is checked once, in the front
end, and its grammar compiled once, in the core; the engine's refusals (`ParameterError`) come back with the
request's field as OpenAI's `param`.

vLLM's request surface: unknown fields ignored with a warning, unimplemented features refused only when they
would change the answer, the penalties and vLLM's sampler fields equal to `LLM.generate` with the same
`SamplingParams`, `echo` with the prompt's logprobs equal to the offline engine's `prompt_logprobs`. A huge
prompt is refused without being tokenised, tokenising happens off the event loop, and the body is capped.

One server (SmolLM2, the engine core in its own process) and one offline `LLM` serve most of the module; two
small servers with the engine core in a thread of this process serve the checks that need to see inside it.
"""

import collections
import contextlib
import json
import logging
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from grading.waits import join_or_fail
from solutions import LLM, SamplingParams
from solutions.engine.processor import Processor
from solutions.entrypoints.openai.api_server import MAX_REQUEST_BODY_BYTES, serve_in_background
from solutions.structured_output.backend_guidance import GuidanceBackend

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 512
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
PROMPT = "The capital of France is"
TOKEN_IDS = [6403, 1980, 253, 655, 28]  # "Once upon a time," as SmolLM2's token ids
CLIENT_PROMPTS = [f"Write a sentence about the number {i}." for i in range(32)]
CONVERSATION = [{"role": "user", "content": "Name three colours."}]
PARIS = 7042  # " Paris" in SmolLM2's vocabulary
# vLLM's sampler fields, each sent as a request field and as the SamplingParams field of the same name
SAMPLER_REQUESTS = {
    "repetition_penalty": dict(repetition_penalty=1.3),
    "presence_frequency": dict(presence_penalty=1.5, frequency_penalty=1.0),
    "min_tokens": dict(min_tokens=MAX_TOKENS, stop_token_ids=[30]),  # "." cannot end it early
    "allowed_token_ids": dict(allowed_token_ids=[PARIS, 30, 28, 253]),  # " Paris", ".", ",", " a"
    "bad_words": dict(bad_words=["Paris"]),
}
METRIC_NAMES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:prompt_tokens", "vllm:generation_tokens",
)


@pytest.fixture(scope="module")
def server():
    with serve_in_background(MODEL, max_model_len=MAX_MODEL_LEN, max_num_seqs=32, engine_core="process") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, max_model_len=MAX_MODEL_LEN, max_num_seqs=32)


@pytest.fixture(scope="module")
def offline(llm) -> dict[str, list[str]]:
    """What `LLM.generate` answers to every request the tests send, computed in one batch: name → texts."""
    chat_prompt = llm.tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    requests = {
        "prompt": (PROMPT, GREEDY),
        "token_ids": (TOKEN_IDS, GREEDY),
        "chat": (chat_prompt, GREEDY),
        "two_samples": (PROMPT, SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=MAX_TOKENS)),
        "no_paris": (PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias={PARIS: -100.0})),
        **{name: (PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **fields))
           for name, fields in SAMPLER_REQUESTS.items()},
        **{f"client_{i}": (prompt, GREEDY) for i, prompt in enumerate(CLIENT_PROMPTS)},
    }
    prompts, params = zip(*requests.values(), strict=True)
    outputs = llm.generate(list(prompts), list(params), use_tqdm=False)
    return {name: [c.text for c in output.outputs] for name, output in zip(requests, outputs, strict=True)}


@pytest.fixture(scope="module")
def prompt_logprobs(llm):
    """The offline engine's `prompt_logprobs=2` for PROMPT: per prompt token (the first: None) {id: Logprob}."""
    (output,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    return output.prompt_logprobs


def post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    """POST JSON with the standard library; (status, parsed body) whatever the status."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def urllib_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def metrics(server) -> dict[str, float]:
    """/metrics parsed with Prometheus's own parser: sample name → value."""
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def wait_until_idle(server, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or holds a KV block; return the last reading either way."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(server)
        gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        idle = [values[f"vllm:{name}"] for name in gauges]
        if idle == [0, 0, 0] or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


# --- answers equal to the offline engine's ---------------------------------------------------------------


def test_completion_greedy_matches_offline_generate(client, offline, llm):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].text == offline["prompt"][0]
    assert response.choices[0].finish_reason == "length"
    prompt_tokens = len(llm.tokenizer.encode(PROMPT))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, MAX_TOKENS)
    assert response.usage.total_tokens == prompt_tokens + MAX_TOKENS


def test_completion_stream_of_token_ids_concatenates_to_offline_generate(client, offline):
    stream = client.completions.create(
        model=MODEL, prompt=TOKEN_IDS, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    *content, usage = list(stream)
    assert len(content) > 1, "the answer must arrive in pieces"
    assert usage.choices == [] and (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (5, MAX_TOKENS)
    assert "".join(c.choices[0].text for c in content) == offline["token_ids"][0]
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]


def test_chat_matches_offline_chat_template(client, offline):
    response = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == offline["chat"][0]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CONVERSATION, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == offline["chat"][0]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_parallel_samples_stream_under_their_index(client, offline):
    expected = offline["two_samples"]
    assert expected[0] != expected[1]
    texts = ["", ""]
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPT, n=2, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, stream=True
    ):
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
    assert texts == expected


def test_stop_string_cuts_the_text(client, offline):
    full = offline["prompt"][0]
    stop = full.split()[2]  # a word the greedy answer is known to reach
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    (choice,) = response.choices
    assert (choice.text, choice.finish_reason) == (full[: full.index(stop)], "stop")
    assert choice.model_extra["stop_reason"] == stop


def test_logprobs_are_the_sampled_tokens(client, offline):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert "".join(logprobs.tokens) == response.choices[0].text == offline["prompt"][0]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert top[token] == logprob == max(top.values())  # greedy: the sampled token is the most likely
        assert len(top) == 2


# --- many clients, and clients that leave ------------------------------------------------------------------


def test_32_concurrent_streaming_clients_each_get_their_own_answer(client, offline, server):
    def stream_one(prompt: str) -> str:
        chunks = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        return "".join(chunk.choices[0].text for chunk in chunks)

    with ThreadPoolExecutor(max_workers=32) as pool:
        texts = list(pool.map(stream_one, CLIENT_PROMPTS))
    assert texts == [offline[f"client_{i}"][0] for i in range(32)]
    assert wait_until_idle(server)["vllm:num_requests_running"] == 0


# A request that nobody aborts runs to the end of the context: ~500 tokens. Counting the tokens generated makes
# the checks below independent of the machine's speed (a fast machine could finish them before the poll ends).
FULL_RUN_TOKENS = MAX_MODEL_LEN - 16


def test_clients_that_disconnect_mid_stream_free_their_blocks(client, server):
    generated_before = metrics(server)["vllm:generation_tokens_total"]
    streams = [
        client.completions.create(model=MODEL, prompt=f"Count to a thousand, {i}:", max_tokens=None, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
        for i in range(4)
    ]
    for stream in streams:
        for _, _chunk in zip(range(3), stream, strict=False):
            pass
    assert metrics(server)["vllm:num_requests_running"] > 0
    for stream in streams:
        stream.close()
    values = wait_until_idle(server)
    assert values["vllm:num_requests_running"] == 0
    assert values["vllm:kv_cache_usage_perc"] == 0
    assert values["vllm:generation_tokens_total"] - generated_before < FULL_RUN_TOKENS  # 4 requests, aborted early


def test_client_that_times_out_on_a_whole_response_frees_its_blocks(server):
    generated_before = metrics(server)["vllm:generation_tokens_total"]
    body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": None, "ignore_eos": True}
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        post(f"{server.base_url}/v1/completions", body, timeout=0.5)
    values = wait_until_idle(server)
    assert values["vllm:num_requests_running"] == 0
    assert values["vllm:kv_cache_usage_perc"] == 0
    assert values["vllm:generation_tokens_total"] - generated_before < FULL_RUN_TOKENS / 2


# --- bad requests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"temperature": -1}, 400, "temperature"),
        ({"top_p": 2}, 400, "top_p"),
        ({"n": 0}, 400, "n"),
        ({"stop": [""]}, 400, "stop"),
        ({"prompt": "word " * MAX_MODEL_LEN}, 400, "prompt"),
        ({"prompt": [1, 2, 10**9]}, 400, "prompt"),  # a token id outside the vocabulary
        ({"prompt": []}, 400, "prompt"),  # no prompt in OpenAI's batch form
        ({"prompt": ["one", ""]}, 400, "prompt"),  # an empty one among them
        ({"max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),  # the prompt and max_tokens must fit in max_model_len
        ({"max_tokens": "many"}, 400, "max_tokens"),  # a field of the wrong type
        ({"max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
        ({"use_beam_search": True}, 400, "use_beam_search"),  # known, not implemented, not neutral
        ({"suffix": "!"}, 400, "suffix"),
        ({"best_of": 3}, 400, "best_of"),
        ({"bad_words": [" "]}, 400, "bad_words"),  # SamplingParams' own check
        ({"repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"logit_bias": {"Paris": 1}}, 400, "logit_bias"),  # keys are token ids
        ({"prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),  # as vLLM: echo them instead
        ({"prompt": None}, 400, "prompt"),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options"),  # without stream: true
        ({"model": "gpt-4"}, 404, "model"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         400, "response_format"),  # a schema that does not compile
        ({"response_format": {"type": "json_schema"}}, 400, "response_format"),  # no schema
        ({"guided_regex": "(unclosed"}, 400, "guided_regex"),
        ({"structured_outputs": {"choice": []}}, 400, "structured_outputs"),
        ({"structured_outputs": {"json_object": True, "whitespace_pattern": "("}}, 400, "structured_outputs"),
        ({"structured_outputs": {"json_object": True, "whitespace_pattern": 3}}, 400, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_choice"),  # two constraints at once
    ],
    ids=lambda value: json.dumps(value)[:40] if isinstance(value, dict) else str(value),
)
def test_bad_completion_requests_are_refused_naming_the_field(server, body, status, param):
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **body}
    if body == {"prompt": None}:
        del request["prompt"]  # missing altogether
    got_status, got = post(f"{server.base_url}/v1/completions", request)
    assert got_status == status
    assert got["error"]["param"] == param
    assert got["error"]["code"] == status
    assert got["error"]["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert param in got["error"]["message"] or status == 404


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_structured_output_through_every_request_field(client):
    """OpenAI's `response_format` (a schema, any object) on chat, vLLM's fields on completions: each output
    conforms, sampled at temperature 1."""
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], temperature=1.0, seed=1, max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    person = json.loads(chat.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and 0 <= person["age"] <= 120
    assert chat.choices[0].finish_reason == "stop"
    anything = client.chat.completions.create(model=MODEL, messages=CONVERSATION, temperature=1.0, seed=2,
                                              max_tokens=64, response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:
        assert anything.choices[0].message.content.startswith("{")
    choice = client.completions.create(model=MODEL, prompt=PROMPT, temperature=1.0, seed=3, max_tokens=8,
                                       extra_body={"guided_choice": ["Paris", "Lyon"]})
    assert choice.choices[0].text in ("Paris", "Lyon")
    digits = client.completions.create(model=MODEL, prompt=PROMPT, temperature=1.0, seed=4, max_tokens=8,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", digits.choices[0].text)
    tabs_only = {"structured_outputs": {"json": PERSON, "whitespace_pattern": r"\t?"}}
    tabbed = client.completions.create(model=MODEL, prompt=PROMPT, temperature=1.0, seed=5, max_tokens=48,
                                       extra_body=tabs_only)
    assert json.loads(tabbed.choices[0].text) and tabbed.choices[0].finish_reason == "stop"
    assert set(re.findall(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", tabbed.choices[0].text))) <= {"\t"}


def test_bad_chat_requests_name_the_chat_field(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_completion_tokens=0)
    assert refused.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    assert refused.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CONVERSATION)


def test_server_keeps_serving_after_bad_requests(client, offline, server):
    for body in ({"temperature": -1}, {"max_tokens": "many"}, {"model": "nope"}, {"prompt": [10**9]}):
        status, _ = post(f"{server.base_url}/v1/completions", {"prompt": PROMPT, **body})
        assert status in (400, 404)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].text == offline["prompt"][0]


# --- vLLM's request surface ---------------------------------------------------------------------------------


def test_unknown_fields_are_ignored_with_a_warning_naming_them(client, offline, caplog):
    """As vLLM's server: a field the server does not know changes nothing, and the log names it."""
    with caplog.at_level(logging.WARNING, logger="solutions.entrypoints.openai.protocol"):
        response = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"max_token": 3, "frobnicate": {"x": 1}},  # a typo, and nonsense
        )
    assert response.choices[0].text == offline["prompt"][0]
    assert "present in the request but ignored: ['frobnicate', 'max_token']" in caplog.text


def test_neutral_values_of_unimplemented_features_are_accepted(client, offline):
    """vLLM's benchmark client always sends `repetition_penalty: 1.0`; other clients send the defaults of features
    this engine lacks. The value that changes nothing is accepted, and the answer is the one without it."""
    neutral = {
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0,
        "logit_bias": {}, "bad_words": [], "allowed_token_ids": None, "use_beam_search": False, "length_penalty": 1.0,
        "include_stop_str_in_output": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
        "truncate_prompt_tokens": None, "suffix": None, "best_of": 1, "echo": False, "user": "me",
    }
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body=neutral)
    assert response.choices[0].text == offline["prompt"][0]
    chat = client.chat.completions.create(
        model=MODEL, messages=CONVERSATION, max_tokens=MAX_TOKENS, temperature=0, user="me",
        metadata={"run": "1"}, extra_body={"tools": [], "tool_choice": "none", "bad_words": []},
    )
    assert chat.choices[0].message.content == offline["chat"][0]


def test_unimplemented_chat_features_are_refused_naming_the_field(client):
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=2, tools=[tool])
    assert refused.value.body["param"] == "tools" and "tools" in refused.value.body["message"]


@pytest.mark.parametrize("name", list(SAMPLER_REQUESTS) + ["no_paris"])
def test_sampler_fields_reach_sampling_params_of_the_same_name(client, offline, name):
    """Each of vLLM's sampler fields, sent as a request field, gives what `LLM.generate` gives with the
    `SamplingParams` field of the same name (greedy, so one answer). `logit_bias` comes in OpenAI's form: token
    ids as strings."""
    fields = {"logit_bias": {str(PARIS): -100.0}} if name == "no_paris" else SAMPLER_REQUESTS[name]
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body=fields)
    assert response.choices[0].text == offline[name][0]
    assert response.choices[0].text != offline["prompt"][0]  # each one changes the greedy answer


def test_developer_and_tool_roles_go_to_the_chat_template(client, llm):
    """`developer` is given to the template as `system`; a tool's result and an assistant's tool calls go as they
    are (SmolLM2's template renders any role): the usage counts the template's tokens."""
    system = [{"role": "system", "content": "Answer in one word."}, *CONVERSATION]
    developer = [{"role": "developer", "content": "Answer in one word."}, *CONVERSATION]
    answers = [
        client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0)
        for messages in (system, developer)
    ]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].usage == answers[1].usage
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    with_tool = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    response = client.chat.completions.create(model=MODEL, messages=with_tool, max_tokens=2, temperature=0)
    rendered = llm.tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"] or ""} for m in with_tool], tokenize=False,
        add_generation_prompt=True,
    )
    assert response.usage.prompt_tokens == len(llm.tokenizer.encode(rendered))


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(server, llm, prompt_logprobs):
    """lm-evaluation-harness's loglikelihood request: `echo`, `logprobs`, `max_tokens` 0. As vLLM: the prompt
    alone, its token logprobs (the first null) equal to the offline engine's `prompt_logprobs`, the one token
    generated dropped from the text but counted in usage."""
    status, got = post(f"{server.base_url}/v1/completions",
                       {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 0})
    assert status == 200
    (choice,) = got["choices"]
    prompt_ids = llm.tokenizer.encode(PROMPT)
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert got["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 1,
                            "total_tokens": len(prompt_ids) + 1}
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == PROMPT
    assert logprobs["text_offset"] == [PROMPT.index(t) for t in logprobs["tokens"]]  # no token repeats here
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for token_id, entry, logprob, top in zip(prompt_ids[1:], prompt_logprobs[1:], logprobs["token_logprobs"][1:],
                                             logprobs["top_logprobs"][1:], strict=True):
        assert logprob == pytest.approx(entry[token_id].logprob, abs=1e-5)
        assert top == pytest.approx({lp.decoded_token: lp.logprob for lp in entry.values()}, abs=1e-5)


def test_echo_streamed_and_with_generation_puts_the_prompt_first(client, offline, server):
    """`echo` with generation: the prompt, then the completion, in the text and in the logprobs (the generated
    tokens' logprobs after the prompt's); streamed, the prompt comes in each sample's first chunk."""
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, echo=True,
                                      logprobs=1)
    (choice,) = whole.choices
    assert choice.text == PROMPT + offline["prompt"][0]
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.token_logprobs[0] is None and None not in choice.logprobs.token_logprobs[1:]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            echo=True, logprobs=1, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [t for c in chunks for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-5)
    assert sum((c.choices[0].logprobs.text_offset for c in chunks), []) == choice.logprobs.text_offset


def test_prompt_logprobs_field_returns_vllms_shape(server, llm, prompt_logprobs):
    status, got = post(f"{server.base_url}/v1/completions",
                       {"model": MODEL, "prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 1, "temperature": 0})
    assert status == 200
    returned = got["choices"][0]["prompt_logprobs"]
    assert returned[0] is None and len(returned) == len(llm.tokenizer.encode(PROMPT))
    for entry, expected in zip(returned[1:], prompt_logprobs[1:], strict=True):
        assert set(entry) == {str(token_id) for token_id in expected}
        for token_id, lp in expected.items():
            assert entry[str(token_id)]["rank"] == lp.rank
            assert entry[str(token_id)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
    assert got["choices"][0]["logprobs"] is None  # no echo, no logprobs asked for


def test_continuous_usage_stats_count_tokens_in_every_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CONVERSATION, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True},
    ))
    counted = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].delta.content]
    assert counted == sorted(counted) and counted[-1] == MAX_TOKENS
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


# --- one request never holds up the others ---------------------------------------------------------------------

HUGE_PROMPT = "word " * 2_000_000  # 10 MB: at least 123,457 tokens, whatever they are


def test_a_huge_prompt_is_refused_without_tokenising_and_tokenising_runs_off_the_event_loop(server, monkeypatch):
    """A 10 MB prompt beside two small streams. The refusal comes from the bound (`Processor.tokenize`: no token
    is longer than 81 characters), so the tokenizer never sees the 10 MB; the small prompts are tokenised in a
    worker thread, not on the server's event loop ("api-server"), so a long tokenisation could not stall the
    others either. Checked by recording the tokenizer's calls (the API server runs in this process); the times
    are only bounded generously: reading and parsing 10 MB takes a fraction of a second, tokenising it ~5 s."""
    tokenizer_class = type(server.engine.tokenizer)
    calls: list[tuple[str, int]] = []
    encode = tokenizer_class.encode

    def recorded(self, text, *args, **kwargs):
        calls.append((threading.current_thread().name, len(text)))
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(tokenizer_class, "encode", recorded)
    small: list[str] = []

    def stream_small(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Small request {i}:", "max_tokens": 16, "stream": True, "ignore_eos": True}
        request = urllib.request.Request(f"{server.base_url}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            small.append(response.read().decode())

    threads = [threading.Thread(target=stream_small, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    start = time.monotonic()
    status, got = post(f"{server.base_url}/v1/completions", {"model": MODEL, "prompt": HUGE_PROMPT, "max_tokens": 2})
    refused_after = time.monotonic() - start
    for thread in threads:
        join_or_fail(thread, 60, what="a small streamed request beside the huge one", likely="the server stalled")
    assert status == 400 and got["error"]["param"] == "prompt"
    assert got["error"]["message"].startswith("prompt has at least 123457 tokens"), got["error"]["message"]
    assert all(text.rstrip().endswith("data: [DONE]") for text in small) and len(small) == 2
    assert [length for _, length in calls if length >= len(HUGE_PROMPT)] == [], "the huge prompt was tokenised"
    assert len(calls) >= 2 and "api-server" not in {thread for thread, _ in calls}
    assert refused_after < 2, f"a prompt that cannot fit took {refused_after:.1f} s to refuse"


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    """A client that announces a body over MAX_REQUEST_BODY_BYTES gets a 413 in OpenAI's shape at once, without
    sending it (here: the headers and 1 KB, then the client waits for the answer)."""
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {MAX_REQUEST_BODY_BYTES + 1}\r\n\r\n".encode() + b'{"prompt": "' + b"x" * 1024
        )
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            received = sock.recv(65536)
            if not received:
                break
            answer += received
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    error = json.loads(body)["error"]
    assert error["code"] == 413 and str(MAX_REQUEST_BODY_BYTES) in error["message"]


# --- checked once in the front end, compiled once in the core (the engine core in a thread of this process) ------

# A small engine, for refusals that depend on its options: 12 KV blocks of 16 tokens hold 192 tokens of a sequence.
SMALL_ENGINE = dict(max_model_len=256, max_num_seqs=4, num_kv_blocks=12)


@contextlib.contextmanager
def thread_server():
    """A server whose engine core runs in a thread of this process (so what the core calls is seen here too)."""
    with serve_in_background(MODEL, engine_core="thread", **SMALL_ENGINE) as running:
        yield running, openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="EMPTY", max_retries=0, timeout=60)


def test_a_request_is_validated_once_in_the_front_end_and_its_grammar_compiled_once_in_the_core(monkeypatch):
    """One chat request with a JSON schema and n=2, through the real client: the front end's processor runs once
    (`Processor.process_inputs`) and validates the schema once (`GuidanceBackend.validate_grammar`), both on the
    server's event-loop thread; the engine core compiles it once (`GuidanceBackend.compile_grammar`, on the core's
    thread), and the second sample's matcher reuses that compiled grammar. The wrappers are installed on the
    classes before the server starts, and the core shares this process, so a call on either side is counted.

    Before the refactor this failed: `AsyncLLM.generate` ran `Processor.process_inputs`, which compiled the schema
    (its own `StructuredOutputManager.grammar_init`) to check it, and the core's `add_request` handed the request
    to a whole `LLMEngine.add_request`, which ran `process_inputs` again and compiled again with the core's
    manager (another cache): two of each, one on each thread (and `validate_grammar` did not exist).
    """
    calls: collections.Counter[tuple[str, str]] = collections.Counter()

    def count(owner: type, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            calls[name, threading.current_thread().name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    count(Processor, "process_inputs")
    count(GuidanceBackend, "validate_grammar")
    count(GuidanceBackend, "compile_grammar")
    with thread_server() as (server, client):
        assert server.engine.engine_core.thread.name == "EngineCore" and server.engine.engine_core.thread.is_alive()
        assert not calls, "nothing is processed or compiled before a request comes"
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], n=2, temperature=1.0, seed=1,
            max_tokens=48, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        )
    assert len(chat.choices) == 2
    for choice in chat.choices:
        person = json.loads(choice.message.content)
        assert set(person) == {"name", "age"} and isinstance(person["age"], int) and 0 <= person["age"] <= 120
        assert choice.finish_reason == "stop"
    assert calls == {
        ("process_inputs", "api-server"): 1,
        ("validate_grammar", "api-server"): 1,
        ("compile_grammar", "EngineCore"): 1,
    }


@pytest.fixture(scope="module")
def small_server():
    with thread_server() as (running, _):
        yield running


LONG_TEXT = "word " * SMALL_ENGINE["max_model_len"]  # 257 tokens: no room left in a context of 256


@pytest.mark.parametrize(
    ("endpoint", "body", "param", "says"),
    [
        ("completions", {"prompt": LONG_TEXT}, "prompt", "max_model_len=256"),
        ("completions", {"prompt": LONG_TEXT, "stream": True}, "prompt", "max_model_len=256"),  # a 400, not a 200
        ("chat", {"messages": [{"role": "user", "content": LONG_TEXT}]}, "messages", "max_model_len=256"),
        ("completions", {"max_tokens": 250}, "max_tokens", "num_kv_blocks=12"),  # 16 blocks for one sequence
        ("chat", {"max_tokens": 220}, "max_tokens", "num_kv_blocks=12"),  # the chat prompt has 34 tokens
        ("chat", {"max_completion_tokens": 220}, "max_completion_tokens", "num_kv_blocks=12"),
        ("completions", {"n": 5}, "n", "max_num_seqs=4"),
        ("chat", {"n": 5, "max_tokens": 4, "stream": True}, "n", "max_num_seqs=4"),
        ("completions", {"top_p": 2}, "top_p", "top_p must be in (0, 1]"),
        ("chat", {"top_p": 2}, "top_p", "top_p must be in (0, 1]"),
        ("chat", {"max_tokens": 4,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no"}}}},
         "response_format", "StructuredOutputsParams.json is not valid"),
    ],
    ids=lambda value: json.dumps(value)[:40] if isinstance(value, dict) else str(value),
)
def test_engine_refusals_name_the_request_field_as_openai_param(small_server, endpoint, body, param, says):
    """The engine's `ParameterError` names its field (`.parameter`); the server answers OpenAI's 400 with `param`
    the request's own name for it: the prompt is "messages" in a chat, `max_tokens` may be sent as
    `max_completion_tokens`. The limits come from this engine's options, so only the engine can refuse these."""
    if endpoint == "chat":
        request = {"model": MODEL, "messages": CONVERSATION, **body}
    else:
        request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **body}
    status, got = post(f"{small_server.base_url}/v1/{'chat/' if endpoint == 'chat' else ''}completions", request)
    assert status == 400
    assert got["error"]["param"] == param
    assert (got["error"]["type"], got["error"]["code"]) == ("BadRequestError", 400)
    assert param in got["error"]["message"] and says in got["error"]["message"], got["error"]["message"]
    ok_status, ok = post(f"{small_server.base_url}/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert ok_status == 200 and ok["usage"]["completion_tokens"] == 2  # and the server serves on


# --- the other endpoints ----------------------------------------------------------------------------------


def test_models_health_and_metrics(client, server):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.max_model_len == MAX_MODEL_LEN
    with urllib.request.urlopen(f"{server.base_url}/health", timeout=10) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        families = {family.name for family in text_string_to_metric_families(response.read().decode())}
    assert set(METRIC_NAMES) <= families
    assert not [name for name in families if name.startswith("vllm:spec_decode")], "registered only with speculation"
    values = metrics(server)
    assert values["vllm:time_to_first_token_seconds_count"] > 0 and values["vllm:prompt_tokens_total"] > 0


def test_engine_death_reaches_clients_and_health(client, server):
    """Last in the module: it kills the module's engine core (as a crash or the OOM killer would)."""
    server.engine.engine_core.process.kill()
    deadline = time.monotonic() + 10
    while (status := urllib_status(f"{server.base_url}/health")) == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status == 503
    with pytest.raises(openai.InternalServerError) as refused:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS)
    assert refused.value.status_code == 500 and "engine" in refused.value.body["message"]
    assert client.models.list().data[0].id == MODEL  # the server itself still answers
