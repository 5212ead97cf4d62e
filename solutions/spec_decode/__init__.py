"""Speculative decoding: proposers that guess the next tokens cheaply, for the target model to verify in one pass.

Where this lives in vLLM: `vllm/v1/spec_decode/` (the rejection sampler that verifies is in `solutions/sample/`).
"""
