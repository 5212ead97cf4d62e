"""The forward pass compiled with `torch.compile`: one graph for every step, attention left to the step's backend.

On the CPU an eager step pays for four things a compiler removes:

- matmuls in the layout the weights were stored in. oneDNN, the CPU matmul library inductor calls, runs fp32
  GEMMs up to 1.6× faster (2× for small batches) on weights reordered once into its blocked layout. Inductor's
  *freezing* treats the weights as constants, so it can reorder (pre-pack) them at compile time;
- elementwise work launched op by op (RMSNorm's five ops, RoPE's seven, SiLU × up, the residual adds), each a
  pass over memory. Inductor fuses each run of them into one C++ loop;
- matmuls that could be one: q_proj, k_proj and v_proj read the same input, as do gate_proj and up_proj.
  k_proj and v_proj are narrow (SmolLM2: 576 -> 192), and a narrow GEMM wastes most of a CPU's vector width;
  with *concat linear*, inductor joins each such set into one wider GEMM on the concatenated frozen weights
  (vLLM stores them joined from the start: `QKVParallelLinear`, `MergedColumnParallelLinear`). Measured on a
  2-core AMD EPYC (2026-11-23), W64's prefill steps took 11.3 s instead of 12.4;
- Python: about 25 ops per layer dispatched one by one.

What the compiler must not see is the attention backend: it is a new Python object every step, holding the
step's metadata as lists, and tracing it would bake one step's batch into the graph. So, as vLLM does, the
model is given a stand-in backend whose `forward` is a custom op, `paged_attention::attention`; the op looks
up the step's real backend in a *forward context* set around the call, and the compiler treats it as a black
box with a known output shape. The graph then holds every layer, embedding to logits, with 30 opaque calls.

Shapes: T (tokens) and B (sequences sampled from) change every step. The graph is compiled with dynamic sizes,
once for all T and B, except that PyTorch specialises a size of 1; a step of one token (one sequence decoding)
is padded to two rows, so that one compile serves every step. The padding row's attention output is zero and
its K/V are never stored (the op hands the backend the real rows only).

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
    if n == q.shape[0]:
        return out
    return torch.cat([out, out.new_zeros(q.shape[0] - n, *out.shape[1:])])


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
