"""Repository-wide pytest setup: offline model loading, and the grading plugin (`--impl`, `--exercise`)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

pytest_plugins = ["grading.plugin"]
