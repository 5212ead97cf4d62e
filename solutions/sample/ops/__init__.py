"""Sampler ops on a batch of logits (vLLM: `vllm/v1/sample/ops/`)."""
