"""Workload W64, drawn one way for every system that runs it: this engine, Hugging Face, and vLLM in its own venv.

64 requests; prompt lengths and output lengths uniform in [16, 256]; prompts are random token ids in
[100, vocab_size - 100) (SmolLM2's special tokens sit below 100); every request asks for exactly its output
length, EOS ignored, greedy. The draw is Python's `random.Random(seed)`: lengths and ids of each prompt in turn,
then the output lengths. This module imports nothing but the standard library, so vLLM's venv, which cannot
install the course, runs the very same draw (`benchmarks/vllm_cpu.py`).
"""

import random


def draw_workload(
    vocab_size: int, num_requests: int = 64, low: int = 16, high: int = 256, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Prompts (token ids) and output lengths; W64 is the default, a smaller run changes the sizes."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab_size - 100) for _ in range(rng.randint(low, high))] for _ in range(num_requests)]
    output_lens = [rng.randint(low, high) for _ in range(num_requests)]
    return prompts, output_lens
