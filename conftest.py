"""Repository-wide pytest setup: offline model loading, and the grading plugin (`--impl`, `--exercise`)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

# Triton reads this switch when it is first imported, and test modules may import transformers (which imports
# Triton) before the course's packages: without a GPU, set it before any of them (see solutions/__init__.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["grading.plugin"]
