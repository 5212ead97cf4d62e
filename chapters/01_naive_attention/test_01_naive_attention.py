"""Grading tests for chapter 01 — naive attention.

Each test grades one exercise (`@pytest.mark.exercise`) against the reference in `solutions/` and, where
one exists, an independent oracle (Hugging Face's own layers, PyTorch's fused attention).
"""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from grading import expect_close, expect_equal
from grading.capstone import CAPSTONE_PROMPTS, smollm2, smollm2_greedy, swap_in
from grading.tiny_models import hf_model, tiny_checkpoint, tiny_model
from solutions.attention import causal as attention
from solutions.baselines import naive
from solutions.model import layers

REFERENCE = {
    "rms_norm": layers.rms_norm,
    "apply_rope": layers.apply_rope,
    "repeat_kv": attention.repeat_kv,
    "causal_attention": attention.causal_attention,
    "decoder_layer": naive.decoder_layer,
    "forward": naive.forward,
    "generate_naive": naive.generate_naive,
}

pytestmark = pytest.mark.timeout(60)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- rms_norm -------------------------------------------------------------------------------------------


@pytest.mark.exercise("rms_norm")
def test_rms_norm_matches_reference(impl):
    x, w = randn(5, 16), randn(16, seed=1)
    expect_close(impl.rms_norm(x, w, 1e-5), layers.rms_norm(x, w, 1e-5), inputs="x randn(5, 16), weight randn(16), eps 1e-5")


@pytest.mark.exercise("rms_norm")
def test_rms_norm_matches_hugging_face(impl):
    norm = LlamaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(randn(32, seed=2))
    x = randn(3, 7, 32, seed=3) * 4
    expect_close(impl.rms_norm(x, norm.weight.detach(), 1e-6), norm(x).detach(), inputs="x randn(3, 7, 32)*4, eps 1e-6 (HF LlamaRMSNorm)")


@pytest.mark.exercise("rms_norm")
def test_rms_norm_uses_eps_for_tiny_inputs(impl):
    x, w = randn(4, 8, seed=4) * 1e-4, torch.ones(8)
    expect_close(impl.rms_norm(x, w, 1e-2), layers.rms_norm(x, w, 1e-2), inputs="x randn(4, 8)*1e-4 (eps dominates), eps 1e-2")


@pytest.mark.exercise("rms_norm")
def test_rms_norm_of_large_float16_activations(impl):
    # Residual streams of real models hold values in the hundreds; their squares overflow float16 (max 65504).
    x = (randn(4, 64, seed=26) * 300).half()
    w = (1 + 0.1 * randn(64, seed=27)).half()
    norm = LlamaRMSNorm(64, eps=1e-5).half()
    with torch.no_grad():
        norm.weight.copy_(w)
    inputs = "x float16 randn(4, 64)*300 (x² overflows float16), weight float16, eps 1e-5 (HF LlamaRMSNorm in float16)"
    expect_close(impl.rms_norm(x, w, 1e-5), norm(x).detach(), inputs=inputs, atol=1e-3, rtol=4e-3)


# --- apply_rope -----------------------------------------------------------------------------------------


def _rope_tables(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return layers.RotaryEmbedding(head_dim, 10000.0, None)(positions)


@pytest.mark.exercise("apply_rope")
def test_apply_rope_matches_hugging_face(impl):
    positions = torch.tensor([0, 1, 2, 7, 30, 100])
    cos, sin = _rope_tables(positions, 16)
    q, k = randn(6, 4, 16, seed=5), randn(6, 2, 16, seed=6)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    inputs = "q randn(6, 4, 16) at positions [0, 1, 2, 7, 30, 100], theta 10000"
    expect_close(impl.apply_rope(q, cos, sin), hf_q[0].transpose(0, 1), inputs=inputs)  # HF's layout: (B, H, T, D)
    expect_close(impl.apply_rope(k, cos, sin), hf_k[0].transpose(0, 1), inputs=inputs.replace("q randn(6, 4", "k randn(6, 2"))


@pytest.mark.exercise("apply_rope")
def test_apply_rope_rotates_each_token_by_its_own_angles(impl):
    positions = torch.tensor([3, 10, 11, 50])
    cos, sin = _rope_tables(positions, 8)
    x = randn(4, 4, 8, seed=30)  # as many tokens as heads: (T, D) tables broadcast against (T, H, D) without an error
    inputs = "x randn(T=4, H=4, 8) at positions [3, 10, 11, 50]: token t's heads all turn by position t's angles"
    expect_close(impl.apply_rope(x, cos, sin), layers.apply_rope(x, cos, sin), inputs=inputs)


@pytest.mark.exercise("apply_rope")
def test_apply_rope_is_identity_at_position_zero(impl):
    cos, sin = _rope_tables(torch.zeros(3, dtype=torch.long), 8)
    x = randn(3, 2, 8, seed=7)
    expect_close(impl.apply_rope(x, cos, sin), x, inputs="x randn(3, 2, 8), all at position 0")


@pytest.mark.exercise("apply_rope")
def test_apply_rope_scores_depend_only_on_distance(impl):
    q, k = randn(1, 1, 16, seed=8), randn(1, 1, 16, seed=9)
    scores = []
    for start in (0, 5, 40):
        cq, sq = _rope_tables(torch.tensor([start + 3]), 16)
        ck, sk = _rope_tables(torch.tensor([start]), 16)
        scores.append((impl.apply_rope(q, cq, sq) * impl.apply_rope(k, ck, sk)).sum())
    expect_close(torch.stack(scores), scores[0].expand(3), inputs="q·k with q three positions after k, k at 0, 5, 40")


# --- repeat_kv ------------------------------------------------------------------------------------------


@pytest.mark.exercise("repeat_kv")
def test_repeat_kv_matches_reference(impl):
    x = randn(5, 3, 4, seed=10)
    expect_close(impl.repeat_kv(x, 3), attention.repeat_kv(x, 3), inputs="x randn(5, Hkv=3, 4), 3 queries per kv head")


@pytest.mark.exercise("repeat_kv")
def test_repeat_kv_groups_neighbouring_query_heads(impl):
    x = torch.arange(2.0)[None, :, None].expand(1, 2, 1)  # kv head h holds the value h
    got = impl.repeat_kv(x, 2)
    expect_equal(got.flatten().tolist(), [0.0, 0.0, 1.0, 1.0], inputs="2 kv heads holding 0 and 1, 2 queries per kv head")


@pytest.mark.exercise("repeat_kv")
def test_repeat_kv_with_one_query_per_kv_is_identity(impl):
    x = randn(4, 2, 8, seed=11)
    expect_close(impl.repeat_kv(x, 1), x, inputs="x randn(4, 2, 8), 1 query per kv head")


# --- causal_attention -----------------------------------------------------------------------------------


@pytest.mark.exercise("causal_attention")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1), (9, 3)])
def test_causal_attention_matches_torch_sdpa(impl, num_heads, num_kv_heads):
    q, k, v = randn(9, num_heads, 8, seed=12), randn(9, num_kv_heads, 8, seed=13), randn(9, num_kv_heads, 8, seed=14)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    got = impl.causal_attention(q, k, v, 8**-0.5)
    expect_close(got, want, inputs=f"q randn(9, {num_heads}, 8), k/v randn(9, {num_kv_heads}, 8), scale 8^-0.5")


@pytest.mark.exercise("causal_attention")
def test_causal_attention_first_token_sees_only_itself(impl):
    q, k, v = randn(4, 2, 8, seed=15), randn(4, 2, 8, seed=16), randn(4, 2, 8, seed=17)
    got = impl.causal_attention(q, k, v, 0.5)
    expect_close(got[0], v[0], inputs="4 tokens; row 0 must equal v[0]")


@pytest.mark.exercise("causal_attention")
def test_causal_attention_ignores_future_tokens(impl):
    q, k, v = randn(6, 2, 8, seed=18), randn(6, 2, 8, seed=19), randn(6, 2, 8, seed=20)
    k2, v2 = k.clone(), v.clone()
    k2[4:], v2[4:] = randn(2, 2, 8, seed=21), randn(2, 2, 8, seed=22)
    got, changed = impl.causal_attention(q, k, v, 0.35), impl.causal_attention(q, k2, v2, 0.35)
    expect_close(changed[:4], got[:4], inputs="6 tokens, then keys/values of tokens 4-5 replaced: rows 0-3 must not change")


# --- decoder_layer, forward, generate_naive on tiny random checkpoints ------------------------------------


@pytest.mark.exercise("decoder_layer")
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias-mqa"])
def test_decoder_layer_matches_reference(impl, name):
    model = tiny_model(name)
    hidden, positions = randn(7, model.config.hidden_size, seed=23), torch.arange(7)
    layer = model.model.layers[1]
    with torch.inference_mode():
        want = naive.decoder_layer(layer, positions, hidden)
        got = impl.decoder_layer(layer, positions, hidden)
    expect_close(got, want, inputs=f"layer 1 of tiny {name}, hidden randn(7, {model.config.hidden_size})")


@pytest.mark.exercise("decoder_layer")
def test_decoder_layer_rotates_by_the_positions_it_is_given(impl):
    model = tiny_model("llama-gqa")
    hidden, positions = randn(7, model.config.hidden_size, seed=25), torch.tensor([0, 2, 3, 7, 8, 12, 30])
    layer = model.model.layers[0]
    with torch.inference_mode():
        want = naive.decoder_layer(layer, positions, hidden)
        got = impl.decoder_layer(layer, positions, hidden)
    inputs = f"layer 0 of tiny llama-gqa, hidden randn(7, {model.config.hidden_size}) at positions {positions.tolist()}"
    expect_close(got, want, inputs=inputs)


@pytest.mark.exercise("forward")
@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha-llama3-rope-bias", "qwen2-bias-mqa", "mistral-linear-rope"])
def test_forward_matches_hugging_face_logits(impl, name):
    folder = tiny_checkpoint(name)
    token_ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(24))
    with torch.inference_mode():
        want = hf_model(folder)(token_ids[None]).logits[0]
        got = impl.forward(tiny_model(name), token_ids)
    expect_close(got, want, inputs=f"tiny {name}, 24 random token ids", atol=1e-4, rtol=1e-4)


@pytest.mark.exercise("generate_naive")
def test_generate_naive_matches_hugging_face_generate(impl):
    folder = tiny_checkpoint("llama-gqa")
    prompt = [5, 17, 42, 99, 3]
    with torch.inference_mode():
        hf = hf_model(folder).generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)
    want = hf[0, len(prompt) :].tolist()
    got = impl.generate_naive(tiny_model("llama-gqa"), prompt, 16)
    expect_equal(got, want, inputs=f"tiny llama-gqa, prompt {prompt}, 16 new tokens (greedy)")


@pytest.mark.exercise("generate_naive")
def test_generate_naive_zero_tokens(impl):
    expect_equal(impl.generate_naive(tiny_model("llama-gqa"), [1, 2, 3], 0), [], inputs="prompt [1, 2, 3], 0 new tokens")


# --- capstone: your pieces together, on the real model ----------------------------------------------------

CAPSTONE_PROMPT = 1  # "Once upon a time": 4 tokens, short enough for the naive loop
CAPSTONE_TOKENS = 6


@pytest.mark.exercise("capstone")
def test_capstone_your_generate_naive_speaks_like_hugging_face(impl):
    """Your generate_naive, running on your forward, decoder_layer, causal_attention, repeat_kv, apply_rope and
    rms_norm, must produce Hugging Face's greedy tokens for SmolLM2-135M-Instruct."""
    model, _ = smollm2()
    prompt = CAPSTONE_PROMPTS[CAPSTONE_PROMPT]
    with swap_in(impl, REFERENCE) as mine:
        got = mine.generate_naive(model, prompt, CAPSTONE_TOKENS)
    inputs = f"SmolLM2-135M-Instruct, prompt {prompt} ('Once upon a time'), {CAPSTONE_TOKENS} new tokens, all your pieces"
    expect_equal(got, smollm2_greedy(CAPSTONE_PROMPT, CAPSTONE_TOKENS), inputs=inputs)
