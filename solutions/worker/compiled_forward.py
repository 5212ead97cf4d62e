"""The forward pass compiled with `torch.compile`: one graph for every step, attention left to the step's backend.

On the CPU an eager step pays for what a compiler removes: matmuls on weights in their stored layout (inductor's
*freezing* pre-packs them into oneDNN's blocked layout, up to 1.6× faster fp32 GEMMs); elementwise ops launched one
by one (RMSNorm, RoPE, SiLU × up, residual adds: fused into one C++ loop per run); narrow matmuls that read the
same input (q/k/v_proj, gate/up_proj: joined by *concat linear* into one wider GEMM, as vLLM's
`QKVParallelLinear` stores them; W64's prefill steps took 11.3 s instead of 12.4 on a 2-core AMD EPYC,
2026-11-23); and about 25 Python dispatches per layer.

The compiler must not see the attention backend: a new Python object every step, holding the step's metadata as
lists, which tracing would bake into the graph. So, as vLLM does, the model gets a stand-in whose `forward` is a
custom op, `paged_attention::attention`, that looks up the step's real backend in a *forward context* set around
the call; the graph holds every layer, embedding to logits, with 30 opaque calls.

T (tokens) and B (sequences sampled from) change every step, so the graph is compiled with dynamic sizes once;
PyTorch specialises a size of 1, so a one-token step is padded to two rows (the padding row's K/V are never
stored: the op hands the backend the real rows only).

Where this lives in vLLM: `vllm/compilation/` (its `@support_torch_compile` decorator and backend),
`vllm/forward_context.py`, and `unified_attention` (the custom op) in
`vllm/model_executor/layers/attention/attention.py`.
"""

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch._inductor.config as inductor_config

from solutions.attention.backend import AttentionBackend
from solutions.attention.inductor_backend import compile_for_any_thread_count
from solutions.model.llama import LlamaForCausalLM

MIN_ROWS = 2  # sizes 0 and 1 are specialised by dynamo: a lone token is padded to this many rows

@dataclass
class ForwardContext:
    """What the attention op needs from the step but the graph must not hold: the backend, and the real rows."""

    backend: AttentionBackend
    num_tokens: int  # rows past this are padding


_forward_context: list[ForwardContext] = []  # the running step's context, while a compiled forward runs


@contextlib.contextmanager
def set_forward_context(backend: AttentionBackend, num_tokens: int) -> Iterator[None]:
    """Make `backend` the one the attention op calls on the first `num_tokens` rows, for one forward pass."""
    _forward_context.append(ForwardContext(backend, num_tokens))
    try:
        yield
    finally:
        _forward_context.pop()


@torch.library.custom_op("paged_attention::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """The step's backend on its real rows: q (T, Hq, D), k, v (T, Hkv, D) -> (T, Hq, D), zeros in padding rows.

    The backend also stores k and v in the paged cache: a side effect the compiler does not see, harmless because
    nothing in the graph reads the cache (the op is its only reader, and runs in layer order).
    """
    context = _forward_context[-1]
    n = context.num_tokens
    out = context.backend.forward(layer_idx, q[:n], k[:n], v[:n])
    return out if n == q.shape[0] else torch.cat([out, out.new_zeros(q.shape[0] - n, *out.shape[1:])])


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
    return torch.empty_like(q)


class ForwardContextAttention:
    """The backend the compiled model sees: every layer's attention goes through the custom op."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, layer_idx)


FORWARD_CONTEXT_ATTENTION = ForwardContextAttention()


class CompiledForward:
    """`model`'s forward pass and LM head as one inductor graph (weights frozen and pre-packed), for every T and B.

    `compile_seconds` adds up the time spent in calls that compiled (the first one, and any recompile).
    """

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.compile_seconds = 0.0
        self._compiled = compile_for_any_thread_count(self._forward)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, last_rows: torch.Tensor) -> torch.Tensor:
        hidden = self.model.model(input_ids, positions, FORWARD_CONTEXT_ATTENTION)  # (T, D_model)
        return self.model.lm_head(hidden[last_rows])  # (B, V)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, last_rows: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """Logits (B, V) at `last_rows` (B,) of the step's T tokens (input_ids, positions (T,)), attending with
        `backend`."""
        num_tokens, num_rows = input_ids.shape[0], last_rows.shape[0]
        if num_tokens < MIN_ROWS:
            input_ids = torch.cat([input_ids, input_ids.new_zeros(MIN_ROWS - num_tokens)])
            positions = torch.cat([positions, positions.new_zeros(MIN_ROWS - num_tokens)])
        if num_rows < MIN_ROWS:
            last_rows = torch.cat([last_rows, last_rows.new_zeros(MIN_ROWS - num_rows)])
        frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        # Freezing (weights as constants, pre-packed for oneDNN) and joining the linears that share an input are
        # inductor settings, read when a graph compiles.
        settings = {"freezing": True, "cpp.enable_concat_linear": True}
        with torch.no_grad(), inductor_config.patch(settings), set_forward_context(backend, num_tokens):
            logits = self._compiled(input_ids, positions, last_rows)
        if torch._dynamo.utils.counters["stats"]["unique_graphs"] != frames_before:
            self.compile_seconds += time.perf_counter() - start
        return logits[:num_rows]  # (B, V)
