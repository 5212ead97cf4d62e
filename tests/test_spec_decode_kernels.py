"""Every attention backend scores a speculative verify — 1 + k new tokens of one sequence, each seeing the context
and the new tokens before it — through the same entry point the engine uses: the backend built from the step's
`AttentionMetadata` as `prepare_inputs` makes it, then `forward` per layer (store the new K/V, attend).

Each batch mixes verifies of 2..8 tokens with plain decodes and prefill chunks, over small blocks so that chunks
cross block boundaries, with GQA, on shuffled block tables; the oracle is chapter 3's `PagedAttention` (a gather
per sequence, then causal attention) on a copy of the same cache. The Triton backend runs its kernels natively on
a GPU when there is one (`grading.devices.DEVICE`), else in Triton's interpreter, so its shapes stay small; the
inductor backend is the CPU's fast path, tested on the CPU: its hand-written C kernel (heads of 16 floats), which
scores a verify's tokens in one read of the context, and its compiled loop (heads of 8), which takes each verify
token as a decode of its own length. The C kernel also takes prefills, cut into pieces of 16 tokens.
"""

import pytest
import torch

from grading.devices import DEVICE
from solutions.attention.inductor_backend import InductorAttentionBackend
from solutions.attention.paged import AttentionMetadata, KVCache, PagedAttention
from solutions.attention.torch_backend import TorchAttentionBackend
from solutions.core.sched.output import SchedulerOutput
from solutions.core.sequence import Sequence
from solutions.worker.model_runner import prepare_inputs

BLOCK_SIZE, NUM_BLOCKS, NUM_KV_HEADS, GROUP, NUM_LAYERS = 4, 48, 2, 3, 2
# (tokens already computed, drafts): a decode has none, a verify 1..7 (1 + k = 2..8 query tokens)
VERIFIES = [(9, 1), (6, 4), (3, 2), (11, 7), (1, 3), (14, 5), (7, 6)]
DECODES = [(5, 0), (12, 0)]
PREFILL_CHUNKS = [(0, 7), (5, 22)]  # (tokens computed, tokens in the chunk): a first chunk, and a later one


def backends() -> list[tuple[str, type, int, torch.device]]:
    """(id, backend class, head size, device)."""
    from solutions.attention.triton_backend import TritonAttentionBackend

    return [
        ("torch", TorchAttentionBackend, 16, torch.device("cpu")),
        ("inductor-c-kernel", InductorAttentionBackend, 16, torch.device("cpu")),
        ("inductor-compiled-loop", InductorAttentionBackend, 8, torch.device("cpu")),
        ("triton", TritonAttentionBackend, 16, DEVICE),
    ]


def make_step(
    batch: list[tuple[int, int, int]], seed: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The step's input ids, positions and metadata from `prepare_inputs`, for sequences given as (tokens computed,
    tokens in the chunk, drafts): each has a shuffled block table wide enough for everything it computes."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    seqs, num_new, spec = [], [], {}
    for seq_id, (computed, chunk, drafts) in enumerate(batch):
        seq = Sequence(seq_id, torch.randint(0, 100, (computed + chunk,), generator=g).tolist())
        end = computed + chunk + drafts
        seq.block_table = [free.pop() for _ in range(-(-end // BLOCK_SIZE))]
        seqs.append(seq)
        num_new.append(chunk + drafts)
        if drafts:
            spec[seq_id] = torch.randint(0, 100, (drafts,), generator=g).tolist()
    scheduler_output = SchedulerOutput(
        scheduled_seqs=seqs, num_scheduled_tokens=num_new, num_computed_tokens=[c for c, _, _ in batch],
        scheduled_spec_decode_tokens=spec,
    )
    return prepare_inputs(scheduler_output, BLOCK_SIZE)


def attend_every_layer(backend_cls: type, kv_cache: KVCache, metadata: AttentionMetadata, qkv: list) -> list:
    backend = backend_cls(kv_cache, metadata)
    return [backend.forward(layer, q, k, v) for layer, (q, k, v) in enumerate(qkv)]


def check_backend_against_the_oracle(backend_cls: type, head_dim: int, device: torch.device, batch, seed: int):
    _, _, metadata = make_step(batch, seed)
    num_tokens = len(metadata.slot_mapping)
    g = torch.Generator().manual_seed(seed + 1)
    cache = KVCache(  # earlier tokens' K/V everywhere: the context, and garbage where nobody may look
        [torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_dim, generator=g) for _ in range(NUM_LAYERS)],
        [torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_dim, generator=g) for _ in range(NUM_LAYERS)],
    )
    qkv = [
        (torch.randn(num_tokens, NUM_KV_HEADS * GROUP, head_dim, generator=g),
         torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=g),
         torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=g))
        for _ in range(NUM_LAYERS)
    ]
    expected = attend_every_layer(PagedAttention, KVCache([c.clone() for c in cache.key_caches],
                                                          [c.clone() for c in cache.value_caches]), metadata, qkv)
    on_device = KVCache([c.to(device) for c in cache.key_caches], [c.to(device) for c in cache.value_caches])
    got = attend_every_layer(backend_cls, on_device, metadata, [tuple(t.to(device) for t in x) for x in qkv])
    for layer, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-5, atol=1e-5, msg=lambda m: f"layer {layer}: {m}")
    torch.testing.assert_close(on_device.key_caches[0].cpu(), cache.key_caches[0])  # the oracle stored the same


@pytest.mark.parametrize("backend", range(4), ids=["torch", "inductor-c-kernel", "inductor-compiled-loop", "triton"])
def test_verifies_mixed_with_decodes_and_prefill_chunks_equal_the_oracle(backend):
    _, backend_cls, head_dim, device = backends()[backend]
    batch = [(c, 1, k) for c, k in VERIFIES[:4]] + [(c, 1, 0) for c, _ in DECODES] + [(c, n, 0) for c, n in
                                                                                     PREFILL_CHUNKS]
    batch += [(c, 1, k) for c, k in VERIFIES[4:]]
    check_backend_against_the_oracle(backend_cls, head_dim, device, batch, seed=backend)


@pytest.mark.parametrize("backend", range(4), ids=["torch", "inductor-c-kernel", "inductor-compiled-loop", "triton"])
def test_a_step_of_only_verifies_equals_the_oracle(backend):
    """A busy engine with speculation on: every sequence brings 1 + k tokens, no decode of one and no prefill."""
    _, backend_cls, head_dim, device = backends()[backend]
    check_backend_against_the_oracle(backend_cls, head_dim, device, [(c, 1, k) for c, k in VERIFIES], seed=10 + backend)


def test_a_verify_token_sees_exactly_the_tokens_before_it():
    """The causal mask inside the chunk, observed: changing the K/V of a verify's last token changes only that
    token's output on the inductor backend (the earlier tokens must not see it)."""
    batch = [(6, 1, 4)]  # positions 6..10 computed, crossing from block 1 into block 2
    _, _, metadata = make_step(batch, seed=3)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(5, NUM_KV_HEADS * GROUP, 16, generator=g)
    k, v = torch.randn(5, NUM_KV_HEADS, 16, generator=g), torch.randn(5, NUM_KV_HEADS, 16, generator=g)
    outputs = []
    for last in (0.0, 5.0):
        kv_cache = KVCache.allocate(type("Shape", (), dict(num_hidden_layers=1, num_key_value_heads=NUM_KV_HEADS,
                                                           head_dim=16)), NUM_BLOCKS, BLOCK_SIZE)
        k_step, v_step = k.clone(), v.clone()
        k_step[-1] += last
        v_step[-1] += last
        outputs.append(InductorAttentionBackend(kv_cache, metadata).forward(0, q, k_step, v_step))
    assert torch.equal(outputs[0][:4], outputs[1][:4])
    assert not torch.allclose(outputs[0][4], outputs[1][4])


def test_prefills_cut_into_pieces_equal_the_oracle():
    """The inductor backend attends prefills in place too, in pieces of 16 query tokens (verify-shaped calls of the
    C kernel): a prompt of a piece and one token more (its last piece moved back over 15 rows written already),
    one of exactly two pieces, chunks after a context, beside a decode and a verify in the same step."""
    batch = [(0, 17, 0), (0, 32, 0), (13, 45, 0), (3, 40, 0), (5, 1, 0), (6, 1, 3)]
    check_backend_against_the_oracle(InductorAttentionBackend, 16, torch.device("cpu"), batch, seed=20)
