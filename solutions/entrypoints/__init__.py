"""Ways into the engine: `LLM`, the offline entry point (`llm.py`), and the OpenAI-compatible server (`openai/`).

Where this lives in vLLM: `vllm/entrypoints/`.
"""
