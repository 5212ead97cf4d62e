"""The draft-model proposer, self-speculative: the target's own first L decoder layers, then its final norm and
LM head, draft the next k tokens greedily.

A draft model must be much cheaper than the target and agree with it often. The target's first layers are one,
with no second checkpoint: they share its embeddings, tokenizer and weights, and the final norm and LM head read
a usable prediction from an early hidden state because the residual stream carries it forward (LayerSkip,
Elhoushi et al. 2024, trains for this; here nothing is trained, and `benchmarks/self_speculation.py` measures the
acceptance rate against L).

Each proposal, for every sequence that sampled this step: catch up — the draft keeps its own K/V for its L layers
in a dense per-sequence cache (chapter 2's, grown by doubling), rewinds it to the longest prefix it shares with the
sequence's tokens (dropping rejected drafts) and reads the tokens it has not seen; then draft k greedy steps. The
linear layers see every sequence's rows at once; attention runs per sequence over its own cache. The drafts are
greedy (q one-hot), so `rejection_sample(..., draft_probs=None)` keeps random sampling exact.

The price of its own cache: L/N of the target's K/V per token, and a catch-up that recomputes L layers for tokens
the target has just computed (vLLM's EAGLE shares the target's hidden states for this reason). A sequence that
leaves the batch loses its draft cache, so the memory is bounded by the batch.

Where this lives in vLLM: `vllm/v1/spec_decode/draft_model.py` (`DraftModelProposer`, method "draft_model", a
separate checkpoint with its own paged KV cache). `num_draft_layers` (the self-speculative draft) is ours.
"""

import itertools
import time

import torch

from solutions.attention.torch_backend import causal_context_attention
from solutions.model.config import ModelConfig
from solutions.model.llama import LlamaForCausalLM


class DraftKVCache:
    """One sequence's keys and values in the draft's L layers: per layer (capacity, Hkv, D), grown by doubling.

    Invariant: slots [0, len(token_ids)) of every layer hold the K/V of `token_ids`, the tokens the draft has read
    (the sequence's verified tokens, then the drafts it fed itself); later slots hold nothing useful.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.token_ids: list[int] = []
        shape = (16, num_kv_heads, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def rewind(self, token_ids: list[int]) -> int:
        """Keep the longest prefix of what was read that `token_ids` starts with, but never the last token (its
        logits give the first draft, so it is read again); return how many tokens are kept."""
        limit = min(self.num_tokens, len(token_ids) - 1)
        kept = next((i for i in range(limit) if self.token_ids[i] != token_ids[i]), limit)
        del self.token_ids[kept:]
        return kept

    def reserve(self, num_tokens: int) -> None:
        """Room for `num_tokens` slots in every layer, doubling the capacity as often as needed."""
        capacity = self.keys[0].shape[0]
        if num_tokens <= capacity:
            return
        while capacity < num_tokens:
            capacity *= 2
        for cache in (self.keys, self.values):
            for i, old in enumerate(cache):
                cache[i] = torch.empty((capacity, *old.shape[1:]), dtype=old.dtype, device=old.device)
                cache[i][: self.num_tokens] = old[: self.num_tokens]


class DraftAttention:
    """The draft's attention backend for one forward: sequence b's new tokens are rows [starts[b], starts[b + 1])
    and follow the `caches[b].num_tokens` tokens it already holds. Each sequence writes its new K/V to its cache,
    then attends causally over all of it, one sequence at a time, within the layer's sliding window if the target's
    `config` gives it one."""

    def __init__(self, caches: list[DraftKVCache], starts: list[int], config: ModelConfig) -> None:
        self.caches, self.starts, self.config = caches, starts, config

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, Hq, D), k and v (T, Hkv, D) for the forward's T new tokens -> (T, Hq, D)."""
        out = torch.empty_like(q)
        window = self.config.sliding_window(layer_idx)
        for cache, lo, hi in zip(self.caches, self.starts[:-1], self.starts[1:], strict=True):
            start, end = cache.num_tokens, cache.num_tokens + hi - lo
            keys, values = cache.keys[layer_idx], cache.values[layer_idx]
            keys[start:end], values[start:end] = k[lo:hi], v[lo:hi]
            out[lo:hi] = causal_context_attention(q[lo:hi], keys[:end], values[:end], q.shape[-1] ** -0.5, window)
        return out


class DraftModelProposer:
    """Drafts `num_speculative_tokens` tokens per sequence with the target's first `num_draft_layers` layers (method
    "draft_model"). `caches` holds a `DraftKVCache` per sequence of the last proposal's batch; the counters show what
    keeping them costs: over `num_proposals` calls, `num_catch_up_tokens` tokens re-read, and the seconds spent in
    catch-up passes (each also yields the first draft) and in the k - 1 later draft steps.
    """

    def __init__(self, model: LlamaForCausalLM, num_draft_layers: int, num_speculative_tokens: int) -> None:
        """The values as `SpeculativeConfig` checked them: 1 <= num_draft_layers < the target's layers, k >= 1."""
        self.model, self.num_draft_layers, self.k = model, num_draft_layers, num_speculative_tokens
        self.layers = model.model.layers[:num_draft_layers]  # the target's own modules: shared weights
        self.caches: dict[int, DraftKVCache] = {}
        self.num_proposals, self.num_catch_up_tokens, self.catch_up_seconds, self.draft_seconds = 0, 0, 0.0, 0.0

    @torch.inference_mode()
    def propose_draft_token_ids(self, seq_ids: list[int], token_ids: list[list[int]]) -> list[list[int]]:
        """The k draft tokens of each sequence, given its tokens so far (prompt, then output)."""
        if not seq_ids:
            self.caches = {}
            return []
        self.caches = {seq_id: self.caches.get(seq_id) or self._new_cache() for seq_id in seq_ids}  # others dropped
        caches = [self.caches[seq_id] for seq_id in seq_ids]
        self.num_proposals += 1
        start = time.perf_counter()
        feeds = [tokens[cache.rewind(tokens) :] for cache, tokens in zip(caches, token_ids, strict=True)]
        self.num_catch_up_tokens += sum(len(feed) for feed in feeds)
        drafts = [[token] for token in self._step(caches, feeds)]
        caught_up = time.perf_counter()
        for _ in range(self.k - 1):
            for draft, token in zip(drafts, self._step(caches, [draft[-1:] for draft in drafts]), strict=True):
                draft.append(token)
        self.catch_up_seconds += caught_up - start
        self.draft_seconds += time.perf_counter() - caught_up
        return drafts

    def _step(self, caches: list[DraftKVCache], feeds: list[list[int]]) -> list[int]:
        """Read each sequence's `feeds` tokens (appended to its cache) through the draft's L layers; return each
        sequence's greedy next token, from its last row."""
        starts = [0, *itertools.accumulate(len(feed) for feed in feeds)]
        device = self.model.lm_head.weight.device
        input_ids = torch.tensor([t for feed in feeds for t in feed], device=device)  # (T,)
        ranges = []
        for cache, feed in zip(caches, feeds, strict=True):
            ranges.append(torch.arange(cache.num_tokens, cache.num_tokens + len(feed)))  # after what it holds
            cache.reserve(cache.num_tokens + len(feed))
        positions = torch.cat(ranges).to(device)  # (T,)
        backend = DraftAttention(caches, starts, self.model.config)
        hidden = self.model.model.embed_tokens(input_ids)  # (T, D_model)
        rope = self.model.model.rotary_emb(positions)  # (cos, sin), (T, D) each
        for layer in self.layers:
            hidden = layer(rope, hidden, backend)  # (T, D_model)
        last = self.model.model.norm(hidden[torch.tensor(starts[1:], device=device) - 1])  # (B, D_model)
        for cache, feed in zip(caches, feeds, strict=True):
            cache.token_ids += feed
        return self.model.compute_logits(last).argmax(dim=-1).tolist()  # (B,) -> B ints

    def _new_cache(self) -> DraftKVCache:
        config, weight = self.model.config, self.model.lm_head.weight
        return DraftKVCache(self.num_draft_layers, config.num_key_value_heads, config.head_dim, weight.dtype,
                            weight.device)
