"""Ways into the engine from outside Python: the OpenAI-compatible HTTP server (`openai/`).

Where this lives in vLLM: `vllm/entrypoints/`.
"""
