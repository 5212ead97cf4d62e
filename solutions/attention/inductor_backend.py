"""The engine's fast CPU backend: decode attention that reads the paged cache in place, compiled by inductor.

The torch backend (`torch_backend.py`) copies every decoding sequence's context out of its blocks before it
attends: per layer, one `index_select` writes a (Bd, L, Hkv, D) copy of the keys and one of the values, and
SDPA then reads the copies. With 64 sequences of 512 tokens that is 50 MB written and read again per layer,
1.5 GB per step — more memory traffic than the step's weights, and on a CPU memory traffic is the step's cost.

Here the gather is written as indexing — slot (b, l) is `block_tables[b, l // block_size] * block_size +
l % block_size` — inside the arithmetic that consumes it: scores as a sum of products over D, a masked
softmax over the context, the output as a probability-weighted sum of values. Eagerly PyTorch would still
materialise the gathered tensors; `torch.compile` (inductor, which emits C++ with OpenMP and SIMD on the CPU)
fuses the indexing into the reductions, so each key and value is loaded from its block and used where it
lies: one pass over the context, no copy. What chapter 6's Triton kernel does by hand, a compiler does here
from eight lines of PyTorch.

The compiled loop pads every sequence to the longest in the batch, and reads the cache at a fraction of the
machine's bandwidth; so decodes go to a kernel written by hand (`cpu_kernels.py`, chapter 6's kernel in C: each
sequence's keys, then its values, read once, nothing past its length), from an fp32 or a bf16 cache, and the
compiled loop serves the rest (fp16, heads that are not a whole number of vectors).

A speculative verify (1 + k new tokens of a decoding sequence) is a decode with more queries: the C kernel scores
all of them, each with its own causal length, while it reads the context once (`max_decode_query_len`). So a
prefill is cut into verify-shaped pieces of 16 tokens, all of a step's pieces in one call, reading the cache in
place where the torch backend calls SDPA per prompt (and gathers a chunk's earlier context first): on a 2-core AMD
EPYC (2026-11-28) PyTorch's fused CPU attention ran at about 60 GFLOP/s on SmolLM2's heads, fp32 or bf16, 0.37 ms
for a prompt of 136 tokens, and the pieces took a step's prefill attention 1.2-2.3x faster (prompts of 32 to 2,048
tokens, and chunks after a context).

Where this lives in vLLM: `vllm/v1/attention/backends/cpu_attn.py` (the CPU backend, with hand-written C++
paged-attention kernels in `csrc/cpu/`).
"""

import functools
from collections.abc import Callable

import torch

from solutions.attention import cpu_kernels
from solutions.attention.causal import visible
from solutions.attention.torch_backend import TorchAttentionBackend


def torch_paged_decode_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, window: int | None = None,
) -> torch.Tensor:
    """One query per sequence, q (Bd, Hq, D), over each sequence's paged context -> (Bd, Hq, D).

    `block_tables` (Bd, max_blocks) int64, `seq_lens` (Bd,), a sliding `window` or None. Eager, this materialises
    the gathered K/V like the torch backend does; compiled (`compiled_paged_decode_attention`), the gathers fuse into
    the reductions.
    """
    Bd, Hq, D = q.shape
    block_size, Hkv = key_cache.shape[1], key_cache.shape[2]
    group, max_blocks = Hq // Hkv, block_tables.shape[1]  # query heads per KV head (GQA); blocks per table
    keys = key_cache[block_tables]  # (Bd, max_blocks, block_size, Hkv, D): fused into the next line when compiled
    values = value_cache[block_tables]  # (Bd, max_blocks, block_size, Hkv, D)
    q = q.view(Bd, 1, 1, Hkv, group, D)
    scores = (q * keys[..., None, :]).sum(-1) * scale  # (Bd, max_blocks, block_size, Hkv, group)
    scores = scores.view(Bd, max_blocks * block_size, Hkv, group)  # position l = block l // bs, slot l % bs
    seen = visible(seq_lens[:, None] - 1, torch.arange(max_blocks * block_size, device=q.device)[None, :], window)
    probs = scores.masked_fill(~seen[:, :, None, None], float("-inf")).softmax(dim=1)  # (Bd, L, ...) over the context
    probs = probs.view(Bd, max_blocks, block_size, Hkv, group)
    out = (probs[..., None] * values[..., None, :]).sum((1, 2))  # (Bd, Hkv, group, D)
    return out.reshape(Bd, Hq, D)


def _keep_all_but_global_state(guards: list) -> list[bool]:
    """Dynamo's guard filter: every guard but the global-state one, which holds torch's thread count."""
    return [guard.guard_type != "GLOBAL_STATE" for guard in guards]


def compile_for_any_thread_count(fn: Callable) -> Callable:
    """`torch.compile(fn, dynamic=True)`, its graphs serving every torch thread count.

    The engine changes the CPU forward pass's thread count as the machine's load changes
    (`solutions/worker/cpu_threads.py`). Two things would recompile at each new count, for half a minute on a
    2-core machine (SmolLM2's forward, measured 2026-11-27): inductor's C++ loops are written for the count at
    compile time, and dynamo guards every graph on its global state, the count included. So the loops read the
    count at run time (`cpp.dynamic_threads`) and the global-state guard is left out; the callers hold the rest of
    that state fixed themselves (they run under `torch.no_grad()`, and a tensor's dtype and device stay guarded).
    """
    options = {"cpp.dynamic_threads": True, "guard_filter_fn": _keep_all_but_global_state}
    return torch.compile(fn, dynamic=True, options=options)


_compiled = compile_for_any_thread_count(torch_paged_decode_attention)


def compiled_paged_decode_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, window: int | None = None,
) -> torch.Tensor:
    """`torch_paged_decode_attention`, compiled on first call for every batch and context (dynamic shapes).

    PyTorch compiles a size of 1 as a constant, so a lone decoding sequence, or a table of one block, would each
    cost a compile of their own; they are padded to two rows (the extra row reads one slot of block 0 and is
    dropped) and two columns (block 0 again, past every sequence's end, so masked).
    """
    Bd = q.shape[0]
    if Bd < 2:
        q = torch.cat([q, q.new_zeros(2 - Bd, *q.shape[1:])])
        block_tables = torch.cat([block_tables, block_tables.new_zeros(2 - Bd, block_tables.shape[1])])
        seq_lens = torch.cat([seq_lens, seq_lens.new_ones(2 - Bd)])
    if block_tables.shape[1] < 2:
        block_tables = torch.cat(
            [block_tables, block_tables.new_zeros(block_tables.shape[0], 2 - block_tables.shape[1])], 1
        )
    return _compiled(q, key_cache, value_cache, block_tables, seq_lens, scale, window)[:Bd]


def fast_decode_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, window: int | None = None,
) -> torch.Tensor:
    """In place: the hand-written C kernel where it applies (`cpu_kernels.supports`: fp32 or bf16 on the CPU, heads
    of a multiple of 16 floats), else the compiled loop above (fp16, odd head sizes).

    q (Bd, Hq, D), or (Bd, Q, Hq, D) for Q new tokens per sequence (a speculative verify: token i sees
    `seq_lens[b] - (Q - 1 - i)` tokens) -> the same shape. The C kernel scores all Q while it reads the context
    once; the compiled loop takes each token as a decode of its own length. A sliding `window` masks each
    query's positions to the last `window` up to its own.
    """
    if cpu_kernels.supports(q, key_cache):
        return cpu_kernels.c_paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale, window)
    if q.dim() == 3:
        return compiled_paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale, window)
    num_queries = q.shape[1]
    row_lens = seq_lens[:, None] - torch.arange(num_queries - 1, -1, -1, device=q.device)[None, :]  # (Bd, Q)
    out = compiled_paged_decode_attention(
        q.flatten(0, 1), key_cache, value_cache, block_tables.repeat_interleave(num_queries, dim=0),
        row_lens.flatten(), scale, window,
    )  # (Bd * Q, Hq, D)
    return out.view_as(q)


class InductorAttentionBackend(TorchAttentionBackend):
    """The torch backend with its decodes attended in place (`fast_decode_attention`), and so is every sequence of
    up to 16 new tokens: a speculative verify of 1 + k tokens costs the C kernel one read of the context, where the
    prefill path would copy it out of its blocks, one sequence at a time.

    Where the C kernel applies, prefills are attended in place too: each prompt (or chunk of one) is cut into
    pieces of `max_decode_query_len` tokens, each a verify-shaped query of the kernel (its tokens see the context
    and the tokens before them), and every piece of the step goes in one call. The last piece of a prompt starts
    `max_decode_query_len` tokens before its end, so every piece is whole; the rows it shares with the piece
    before it are written once."""

    devices = ("cpu",)
    compiles_on = ("cpu",)  # the whole forward pass, at start-up
    supports_tensor_parallel = False  # the compiled graph is one process's whole model
    decode_attention = staticmethod(fast_decode_attention)
    max_decode_query_len = 16

    @functools.cached_property
    def pieces(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """The step's prefill pieces, made at the first layer that needs them: (their query rows (P * n,), where in
        those rows each prefill row is first found (None: nowhere twice), each piece's length (what its last token
        sees: the context and the new tokens to the piece's end) and its sequence's block table)."""
        n = self.max_decode_query_len
        rows: list[int] = []
        keep: list[int] = []
        lens: list[int] = []
        sequences: list[int] = []
        for b in self.prefills:
            first, num_new = self.query_starts[b], self.query_starts[b + 1] - self.query_starts[b]  # num_new > n
            for start in range(0, num_new, n):
                begin = min(start, num_new - n)  # the last piece moved back to be whole
                keep += range(len(rows) + start - begin, len(rows) + n)
                rows += range(first + begin, first + begin + n)
                lens.append(self.seq_lens[b] - num_new + begin + n)
                sequences.append(b)
        device = self.slot_mapping.device
        tables = self.metadata.block_table_tensor[torch.tensor(sequences)].to(device=device, dtype=torch.long)
        keep_rows = None if len(keep) == len(rows) else torch.tensor(keep, device=device)
        return torch.tensor(rows, device=device), keep_rows, torch.tensor(lens, device=device), tables

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, out: torch.Tensor, scale: float, window: int | None) -> None:
        """Every prefill piece in one call of the C kernel, reading the cache in place (the new K/V are already
        stored), each token within the sliding `window` if there is one; the torch backend's way where the kernel
        does not apply."""
        if not cpu_kernels.supports(q, key_cache):
            return super().prefill_attention(q, k, v, key_cache, value_cache, out, scale, window)
        rows, keep, lens, tables = self.pieces
        queries = q[rows].view(-1, self.max_decode_query_len, *q.shape[1:])  # (P, n, Hq, D)
        attended = cpu_kernels.c_paged_decode_attention(queries, key_cache, value_cache, tables, lens, scale, window)
        attended = attended.view(-1, *q.shape[1:])  # (P * n, Hq, D)
        if keep is None:
            out[rows] = attended
        else:
            out[rows[keep]] = attended[keep]
