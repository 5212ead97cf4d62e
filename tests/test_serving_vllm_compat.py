"""The server against vLLM's behaviour, where clients depend on it: a list of prompts per completions request
(lm-evaluation-harness's `local-completions` at `batch_size` > 1), `max_tokens` that cannot fit in the context
refused naming the field, `/tokenize` and `/detokenize`, the prompt's logprobs in each choice with `echo`, error
messages free of the server's internal request ids, and `response_format: json_object` finishing a clean object.

lm-evaluation-harness is not installed here, so its requests are sent as its source builds them
(`lm_eval/models/openai_completions.py`: `LocalCompletionsAPI._create_payload` and `parse_logprobs`, which sorts
the choices by `index` and scores `token_logprobs[ctxlen:-1]` of choice i against request i). One live server
(SmolLM2, the engine core in its own process) and one offline `LLM` serve the module.
"""

import http.client
import json
import time
import urllib.request
from operator import itemgetter
from urllib.parse import urlsplit

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from solutions import LLM, SamplingParams
from solutions.entrypoints.openai.api_server import serve_in_background

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 8
PROMPT = "The capital of France is"
# lm-evaluation-harness loglikelihood requests: (context, continuation)
LOGLIKELIHOOD_REQUESTS = [
    ("Question: What is the capital of France?\nAnswer:", " Paris"),
    ("Question: What is the capital of France?\nAnswer:", " London"),
    ("The cat sat on the", " mat"),
    ("Water boils at a temperature of", " 100 degrees Celsius"),
    ("One, two, three,", " four"),
    ("The opposite of hot is", " cold"),
]
JSON_QUESTION = [{"role": "user", "content": "Invent a person: give a name and an age."}]


@pytest.fixture(scope="module")
def server():
    with serve_in_background(MODEL, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS)


def send(server, path: str, body: dict) -> tuple[int, bytes]:
    """POST `body` as JSON (as `requests.post(json=...)` does); (status, raw body)."""
    url = urlsplit(server.base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def post(server, path: str, body: dict) -> tuple[int, dict]:
    status, raw = send(server, path, body)
    return status, json.loads(raw)


def sse_chunks(raw: bytes) -> list[dict]:
    messages = [m.strip() for m in raw.decode().split("\n\n") if m.strip()]
    assert messages[-1] == "data: [DONE]"
    return [json.loads(m.removeprefix("data: ")) for m in messages[:-1]]


def wait_until_idle(server, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or holds a KV block; the last reading either way."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as response:
            text = response.read().decode()
        values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
        gauges = [values[f"vllm:{name}"] for name in ("num_requests_running", "num_requests_waiting",
                                                       "kv_cache_usage_perc")]
        if gauges == [0, 0, 0] or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


# --- a list of prompts per request ------------------------------------------------------------------------------


def lm_eval_loglikelihoods(server, llm, batch_size: int) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's `local-completions` loglikelihood at `batch_size`: the token ids of context +
    continuation, `batch_size` of them per request; `parse_logprobs` on each response."""
    tokenizer = llm.tokenizer
    requests = [(tokenizer.encode(context), tokenizer.encode(continuation))
                for context, continuation in LOGLIKELIHOOD_REQUESTS]
    results = []
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        payload = {"model": MODEL, "prompt": [context + continuation for context, continuation in batch],
                   "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
        status, out = post(server, "/v1/completions", payload)
        assert status == 200, out
        assert [c["index"] for c in out["choices"]] == list(range(len(batch)))
        ctxlens = [len(context) for context, _ in batch]
        for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens, strict=True):
            token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
            top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
            is_greedy = all(lp == max(top.values()) for lp, top in zip(token_logprobs, top_logprobs, strict=True))
            results.append((sum(token_logprobs), is_greedy))
        total = sum(len(context) + len(continuation) for context, continuation in batch)
        assert out["usage"] == {"prompt_tokens": total, "completion_tokens": len(batch),
                                "total_tokens": total + len(batch)}
    return results


def test_lm_eval_local_completions_batch_4_scores_as_batch_1(server, llm):
    """The acceptance test of the batch form: lm-eval's loglikelihoods at batch_size 4 (a request of 4 prompts,
    then one of 2) equal those at batch_size 1, and the offline engine's prompt logprobs."""
    one_by_one = lm_eval_loglikelihoods(server, llm, batch_size=1)
    batched = lm_eval_loglikelihoods(server, llm, batch_size=4)
    assert [greedy for _, greedy in batched] == [greedy for _, greedy in one_by_one]
    assert [score for score, _ in batched] == pytest.approx([score for score, _ in one_by_one], abs=1e-4)
    prompts = [llm.tokenizer.encode(context + continuation) for context, continuation in LOGLIKELIHOOD_REQUESTS]
    offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    for (context, _), ids, output, (score, _) in zip(LOGLIKELIHOOD_REQUESTS, prompts, offline, batched, strict=True):
        ctxlen = len(llm.tokenizer.encode(context))
        expected = sum(output.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i >= ctxlen)
        assert score == pytest.approx(expected, abs=1e-4)


def test_lm_eval_generate_until_in_a_batch(server, llm):
    """`_create_payload(generate=True)` with a batch of token-id prompts: `parse_generations` reads the choices
    sorted by index, each the offline engine's greedy text for its prompt."""
    prompts = [llm.tokenizer.encode(context) for context, _ in LOGLIKELIHOOD_REQUESTS[2:6]]
    payload = {"prompt": prompts, "model": MODEL, "max_tokens": 8, "temperature": 0,
               "stop": ["\n", "<|endoftext|>"], "seed": 1234}
    status, out = post(server, "/v1/completions", payload)
    assert status == 200
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, stop=["\n", "<|endoftext|>"]),
                            use_tqdm=False)
    texts = [choice["text"] for choice in sorted(out["choices"], key=itemgetter("index"))]
    assert texts == [output.outputs[0].text for output in expected]


def test_a_batch_of_texts_with_n_numbers_choices_prompt_by_prompt(client, llm):
    """Texts, n=2, echo and logprobs: choice `i * n + j` is prompt i's sample j (its text starts with prompt i);
    streamed, each chunk's choice carries that index and the chunks of one index concatenate to its text."""
    prompts = ["The capital of France is", "The history of the printing press begins", "Once upon a time"]
    whole = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0, echo=True,
                                      logprobs=1, extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == list(range(6))
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for choice in whole.choices:
        prompt_index = choice.index // 2
        assert choice.text == prompts[prompt_index] + expected[prompt_index].outputs[0].text
        assert "".join(choice.logprobs.tokens) == choice.text and choice.logprobs.token_logprobs[0] is None
    num_prompt = sum(len(llm.tokenizer.encode(p)) for p in prompts)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (num_prompt, 6 * 6)
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0, echo=True, logprobs=1, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    streamed = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {choice.index: choice.text for choice in whole.choices}


def test_a_batch_with_one_bad_prompt_is_refused_whole_and_leaves_nothing_running(server):
    """Prompt 1 of 3 would run past max_model_len: 400 naming max_tokens, whole or streamed, and no prompt of the
    batch is left in the engine; the server serves on."""
    long_ids = list(range(1000, 1000 + MAX_MODEL_LEN - 8))  # room for 8 generated tokens
    for stream in (False, True):
        status, got = post(server, "/v1/completions", {
            "model": MODEL, "prompt": [[1000, 1001], long_ids, [1002]], "max_tokens": 16, "stream": stream,
        })
        assert status == 400 and got["error"]["param"] == "max_tokens"
        assert f"({16} > {MAX_MODEL_LEN} - {len(long_ids)})" in got["error"]["message"]
    # the engine refuses prompt 2 (no room left to generate) once prompt 1 is queued: prompt 1 is aborted
    too_long = list(range(1000, 1000 + MAX_MODEL_LEN))
    for stream in (False, True):
        status, got = post(server, "/v1/completions", {"model": MODEL, "prompt": [[1000, 1001], too_long],
                                                       "max_tokens": None, "stream": stream})
        assert status == 400 and got["error"]["param"] == "prompt"
        assert f"max_model_len={MAX_MODEL_LEN}" in got["error"]["message"]
    values = wait_until_idle(server)
    assert [values[f"vllm:{g}"] for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")] \
        == [0, 0, 0]
    status, ok = post(server, "/v1/completions", {"model": MODEL, "prompt": [PROMPT, PROMPT], "max_tokens": 2,
                                                  "temperature": 0})
    assert status == 200 and len(ok["choices"]) == 2 and ok["choices"][0]["text"] == ok["choices"][1]["text"]


def test_a_batch_whose_client_leaves_is_aborted_prompt_by_prompt(client, server, llm):
    """Every prompt of a batch is its own engine request: a client that closes a streamed batch mid-way, or gives
    up on a whole one, leaves none of them running or holding blocks, well before they could have finished."""
    prompts = [f"Count to a thousand, {i}:" for i in range(3)]
    full_run = sum(MAX_MODEL_LEN - len(llm.tokenizer.encode(prompt)) for prompt in prompts)
    body = dict(model=MODEL, prompt=prompts, max_tokens=None, temperature=0, extra_body={"ignore_eos": True})
    for whole in (False, True):
        generated_before = wait_until_idle(server)["vllm:generation_tokens_total"]
        if whole:
            impatient = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", max_retries=0, timeout=0.5)
            with pytest.raises(openai.APITimeoutError):
                impatient.completions.create(**body)
        else:
            stream = client.completions.create(**body, stream=True)
            seen = {chunk.choices[0].index for _, chunk in zip(range(12), stream, strict=False)}
            assert seen == {0, 1, 2}
            stream.close()
        values = wait_until_idle(server)
        assert (values["vllm:num_requests_running"], values["vllm:kv_cache_usage_perc"]) == (0, 0)
        assert values["vllm:generation_tokens_total"] - generated_before < full_run / 2


# --- max_tokens must fit in the context ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "field"),
    [("completions", "max_tokens"), ("chat", "max_tokens"), ("chat", "max_completion_tokens")],
)
def test_max_tokens_past_max_model_len_is_refused_naming_the_field(server, llm, endpoint, field):
    """As vLLM: prompt + max_tokens > max_model_len is a 400 naming the request's field, with vLLM's message;
    exactly max_model_len is accepted (a one-token choice ends it at once)."""
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}
        num_prompt = len(llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
            body["messages"], tokenize=False, add_generation_prompt=True)))
    else:
        path, body = "/v1/completions", {"prompt": PROMPT}
        num_prompt = len(llm.tokenizer.encode(PROMPT))
    room = MAX_MODEL_LEN - num_prompt
    for stream in (False, True):
        status, got = post(server, path, {"model": MODEL, **body, field: room + 1, "stream": stream})
        assert status == 400 and got["error"]["param"] == field
        assert got["error"]["message"] == (
            f"'max_tokens' or 'max_completion_tokens' is too large: {room + 1}. This model's maximum context length "
            f"is {MAX_MODEL_LEN} tokens and your request has {num_prompt} input tokens "
            f"({room + 1} > {MAX_MODEL_LEN} - {num_prompt})."
        )
    status, got = post(server, path, {"model": MODEL, **body, field: room, "guided_choice": ["yes"]})
    assert status == 200, got


# --- /tokenize and /detokenize ---------------------------------------------------------------------------------


def test_tokenize_round_trips_through_detokenize_and_counts_as_completions_do(server, llm):
    text = "Paged attention stores the KV cache in blocks. Ça marche!"
    status, got = post(server, "/tokenize", {"model": MODEL, "prompt": text})
    assert status == 200
    assert got == {"count": len(got["tokens"]), "max_model_len": MAX_MODEL_LEN, "tokens": llm.tokenizer.encode(text),
                   "token_strs": None}
    status, back = post(server, "/detokenize", {"model": MODEL, "tokens": got["tokens"]})
    assert status == 200 and back == {"prompt": text}
    status, completion = post(server, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1})
    assert completion["usage"]["prompt_tokens"] == got["count"]
    status, with_strs = post(server, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert with_strs["token_strs"] == llm.tokenizer.convert_ids_to_tokens(got["tokens"])


def test_tokenize_messages_counts_as_the_chat_endpoint(server, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    status, got = post(server, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200
    rendered = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got["tokens"] == llm.tokenizer.encode(rendered, add_special_tokens=False)
    status, chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == got["count"]
    status, open_ended = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert open_ended["count"] < got["count"]  # no "<|im_start|>assistant\n" at the end
    status, back = post(server, "/detokenize", {"tokens": got["tokens"]})
    assert back["prompt"] == rendered


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {}, 400, "messages"),  # neither prompt nor messages
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "messages"),
        ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, 400, "messages"),
        ("/detokenize", {"tokens": [1, 2, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "hello"}, 400, "tokens"),
    ],
    ids=lambda value: json.dumps(value)[:40] if isinstance(value, dict) else str(value),
)
def test_bad_tokenize_and_detokenize_requests_name_the_field(server, path, body, status, param):
    got_status, got = post(server, path, body)
    assert got_status == status and got["error"]["param"] == param and got["error"]["code"] == status
    assert param in got["error"]["message"] or status == 404


# --- echo's prompt logprobs, and error messages ----------------------------------------------------------------


def test_echo_with_logprobs_fills_each_choices_prompt_logprobs(server, llm):
    """As vLLM: `echo` with `logprobs` asks the engine for the prompt's logprobs, and each choice carries its own
    prompt's `prompt_logprobs` (per token {id: {logprob, rank, decoded_token}}, the first null), the same values
    as the echoed `token_logprobs`. Without either, `prompt_logprobs` is null."""
    prompts = ["The capital of France is", "Once upon a time"]
    status, got = post(server, "/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 1,
                                                   "temperature": 0, "echo": True, "logprobs": 1})
    assert status == 200
    for choice, prompt in zip(got["choices"], prompts, strict=True):
        ids = llm.tokenizer.encode(prompt)
        prompt_logprobs = choice["prompt_logprobs"]
        assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
        for position, token_id in enumerate(ids[1:], start=1):
            entry = prompt_logprobs[position][str(token_id)]
            assert entry["logprob"] == pytest.approx(choice["logprobs"]["token_logprobs"][position], abs=1e-6)
            assert entry["decoded_token"] == choice["logprobs"]["tokens"][position]
    status, plain = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "echo": True})
    assert plain["choices"][0]["prompt_logprobs"] is None


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"prompt": [1, 2, 10**9]}, "prompt", f"token id {10**9} is out of vocabulary"),
        ({"prompt": [[5], [1, 10**9]]}, "prompt", f"token id {10**9} is out of vocabulary"),
        ({"n": MAX_NUM_SEQS + 1}, "n", f"exceeds max_num_seqs={MAX_NUM_SEQS}"),  # the engine's own message
    ],
    ids=lambda value: json.dumps(value)[:40] if isinstance(value, dict) else str(value),
)
def test_refusals_carry_no_internal_request_id(server, body, param, says):
    status, got = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **body})
    assert status == 400 and got["error"]["param"] == param
    message = got["error"]["message"]
    assert says in message and param in message
    assert "cmpl-" not in message and "request '" not in message, message


# --- response_format: json_object ------------------------------------------------------------------------------


def test_json_object_greedy_finishes_a_valid_object(client):
    """The issue's case: greedy SmolLM2 with `{"type": "json_object"}` wrote `{"Alec":18,"Alec-18":18,...` until
    max_tokens under a grammar without whitespace; with whitespace allowed (a bounded run, by default) it closes an
    object."""
    chat = client.chat.completions.create(model=MODEL, messages=JSON_QUESTION, temperature=0, max_tokens=64,
                                          response_format={"type": "json_object"})
    (choice,) = chat.choices
    assert choice.finish_reason == "stop" and chat.usage.completion_tokens < 64
    person = json.loads(choice.message.content)
    assert isinstance(person, dict) and person, choice.message.content
