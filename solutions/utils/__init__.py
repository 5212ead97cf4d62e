"""Small helpers every layer may use, each in the module vLLM keeps it in.

Where this lives in vLLM: `vllm/utils/` (`math_utils.py`: `cdiv`).
"""
