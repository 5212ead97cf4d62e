"""Tiny random Llama-family checkpoints for fast, exact tests.

Each is built by `transformers` from a config and a fixed seed, saved as an ordinary Hugging Face folder,
and loaded back through our own loader — so the tests exercise the real loading path for Llama, Qwen2
and Mistral checkpoints, and can compare against the Hugging Face model of the very same weights.
"""

from pathlib import Path
from typing import Any

import torch

from solutions.envs import cache_dir
from solutions.model.loader import load_model
from solutions.model.llama import LlamaForCausalLM

_BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=512,
    initializer_range=0.2,  # large weights: peaked logits, so greedy choices are far from ties
    tie_word_embeddings=False,
)

# name -> (transformers config class, its arguments): different head counts, rope settings, biases.
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("LlamaConfig", dict(_BASE, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)),
    "llama-mha-llama3-rope-bias": (
        "LlamaConfig",
        dict(
            _BASE,
            num_attention_heads=4,
            num_key_value_heads=4,
            attention_bias=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "qwen2-bias-mqa": (
        "Qwen2Config",
        dict(_BASE, num_attention_heads=4, num_key_value_heads=1, rope_theta=1000000.0, tie_word_embeddings=True),
    ),
    "mistral-linear-rope": (
        "MistralConfig",
        dict(
            _BASE,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=None,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
        ),
    ),
}


def tiny_checkpoint(name: str, seed: int = 0, max_position_embeddings: int | None = None) -> Path:
    """Folder of the tiny checkpoint `name` (built on first use, then cached). `max_position_embeddings` raises the
    context limit (512) for a run over long contexts; the weights are the same."""
    suffix = "" if max_position_embeddings is None else f"-pos{max_position_embeddings}"
    folder = cache_dir() / "tiny" / f"{name}-seed{seed}{suffix}"
    if not (folder / "config.json").exists():
        import transformers

        class_name, kwargs = TINY_CONFIGS[name]
        if max_position_embeddings is not None:
            kwargs = dict(kwargs, max_position_embeddings=max_position_embeddings)
        config = getattr(transformers, class_name)(**kwargs)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(folder)
    return folder


def tiny_model(name: str, seed: int = 0) -> LlamaForCausalLM:
    return load_model(str(tiny_checkpoint(name, seed)))


def hf_model(folder: Path) -> torch.nn.Module:
    """The Hugging Face implementation of the same checkpoint: the oracle our forward is held to."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # a bar per load is noise in tests and notebooks
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def prompts_with_a_shared_head(
    count: int, vocab_size: int, seed: int, head_len: int = 20, max_own: int = 40, every: int = 2
) -> list[list[int]]:
    """`count` random prompts of 1 to `max_own - 1` tokens; every `every`-th one (the first included) after one
    common head of `head_len` tokens, so an engine finds it in its prefix cache."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(100, vocab_size, (head_len,), generator=g).tolist()
    own = [torch.randint(100, vocab_size, (int(torch.randint(1, max_own, (1,), generator=g)),), generator=g).tolist()
           for _ in range(count)]
    return [shared + tokens if i % every == 0 else tokens for i, tokens in enumerate(own)]


def sampled_token_ids(llm, prompts: list[list[int]], params) -> list[list[list[int]]]:
    """Each prompt's samples' token ids, from `llm.generate` (an `LLM`)."""
    return [[sample.token_ids for sample in output.outputs] for output in llm.generate(prompts, params, use_tqdm=False)]
