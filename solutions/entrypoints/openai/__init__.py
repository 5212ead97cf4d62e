"""The OpenAI-compatible server: `/v1/completions` and `/v1/chat/completions` (streamed over SSE or not),
`/v1/models`, `/health` and `/metrics`, on FastAPI and uvicorn, in front of an `AsyncLLM`.

    protocol.py            the requests and responses, in OpenAI's JSON shapes; request → SamplingParams
    serving_engine.py      what both endpoints share: model check, prompt limits, errors, disconnects, SSE
    serving_completion.py  /v1/completions
    serving_chat.py        /v1/chat/completions (the tokenizer's chat template, then as a completion)
    api_server.py          the FastAPI app, and a server started in the background for tests and benchmarks
    cli_args.py            the command line of `python -m solutions.serve`: every `LLM` keyword is a flag

Where this lives in vLLM: `vllm/entrypoints/openai/`.
"""
