"""Integer arithmetic the engine's layers share: the front end sizes a request's blocks with it, the KV cache
manager allocates with it, so it lives below both.

Where this lives in vLLM: `vllm/utils/math_utils.py` (`cdiv`).
"""


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints: the number of blocks needed for `a` tokens."""
    return -(-a // b)
