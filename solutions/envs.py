"""Settings read from the environment, in one place.

Where this lives in vLLM: `vllm/envs.py` (`VLLM_CACHE_ROOT` and the rest).
"""

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted checkpoints and compiled kernels live: $PAGED_ATTENTION_CACHE, else
    ~/.cache/paged-attention-course."""
    default = Path.home() / ".cache" / "paged-attention-course"
    return Path(os.environ.get("PAGED_ATTENTION_CACHE", default))
