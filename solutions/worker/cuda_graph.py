"""Decode steps as CUDA graphs: record a decode step's kernel launches once per batch size, then replay them.

A small model's decode step is launch-bound: 30 layers × a dozen kernels, each a few microseconds of GPU work
behind as much Python and driver overhead. A graph records the launches once and replays them with one call, but
everything it touches is fixed at capture: the tensors (inputs are copied into static buffers), their shapes (one
graph per batch size) and host decisions (nothing is read back inside the forward pass). So, as vLLM and
nano-vllm do:

- sizes 1, 2, 4, 8, ... up to `max_num_seqs` (and it); B sequences replay the smallest size N >= B, padded;
- a padding row is token 0 at position 0, slot -1 (`PAD_SLOT_ID`: never stored), seq_len 1 and a block table row
  of zeros (it reads block 0's first slot, finite since pools are zeroed; its output row is dropped);
- block tables are `max_model_len / block_size` wide, so one graph serves every context length;
- only pure-decode steps with the Triton backend (its launches read metadata from device tensors); prefills, mixed
  and larger steps run eagerly, as does everything with `enforce_eager=True` or on the CPU;
- what is captured is the runner's forward callable (the compiled forward pass when there is one,
  `compiled_forward.py`), the LM head included, so a graph's output is the rows' logits.

Where this lives in vLLM: `vllm/v1/worker/gpu_model_runner.py` (`capture_model`, `_dummy_run`), the sizes in
`vllm/config` (`cudagraph_capture_sizes`); nano-vllm: `ModelRunner.capture_cudagraph`.
"""

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from solutions.attention.backend import AttentionBackend
from solutions.attention.paged import AttentionMetadata, KVCache
from solutions.attention.triton_backend import TritonAttentionBackend
from solutions.model.llama import LlamaForCausalLM
from solutions.utils.math_utils import cdiv

# A step's forward pass as the runner calls it: (input_ids, positions (T,), last_rows (B,), backend) -> logits (B, V)
ForwardLogits = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBackend], torch.Tensor]

PAD_SLOT_ID = -1  # a padding token's slot: the store kernel skips it


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes that get a graph: powers of two below `max_num_seqs`, then `max_num_seqs` itself. Padding at
    most doubles a batch's rows, which a small model's launch-bound decode step barely notices."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    return [1 << i for i in range((max_num_seqs - 1).bit_length())] + [max_num_seqs]


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `num_seqs` rows, or None past the largest (the step runs eagerly)."""
    return next((size for size in sizes if size >= num_seqs), None)


@dataclass
class PaddedDecodeBatch:
    """A decode step's inputs padded to a graph's N rows (host tensors, copied into the static buffers)."""

    input_ids: torch.Tensor  # (N,) int64, 0 in padding rows
    positions: torch.Tensor  # (N,) int64, 0 in padding rows
    slot_mapping: torch.Tensor  # (N,) int64, PAD_SLOT_ID in padding rows: nothing is written
    seq_lens: torch.Tensor  # (N,) int32, 1 in padding rows: one finite slot is read
    block_tables: torch.Tensor  # (N, max_blocks) int32, zeros past each table and in padding rows


def pad_decode_batch(
    input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, num_rows: int, max_blocks: int
) -> PaddedDecodeBatch:
    """Pad a pure-decode step of B sequences (one token each: input_ids, positions (B,)) to `num_rows` >= B rows
    and its block tables to `max_blocks` columns."""
    num_seqs = len(metadata.block_tables)
    if not (input_ids.shape[0] == positions.shape[0] == int(metadata.query_start_loc[-1]) == num_seqs):
        raise ValueError("a padded decode batch needs exactly one new token per sequence")
    if not num_seqs <= num_rows:
        raise ValueError(f"a step of {num_seqs} sequences does not fit a graph of {num_rows} rows")
    widest = max((len(table) for table in metadata.block_tables), default=0)
    if widest > max_blocks:
        raise ValueError(f"a block table of {widest} blocks does not fit the graph's {max_blocks} columns")
    batch = PaddedDecodeBatch(
        input_ids=torch.zeros(num_rows, dtype=torch.long),
        positions=torch.zeros(num_rows, dtype=torch.long),
        slot_mapping=torch.full((num_rows,), PAD_SLOT_ID, dtype=torch.long),
        seq_lens=torch.ones(num_rows, dtype=torch.int32),
        block_tables=torch.zeros(num_rows, max_blocks, dtype=torch.int32),
    )
    batch.input_ids[:num_seqs] = input_ids
    batch.positions[:num_seqs] = positions
    batch.slot_mapping[:num_seqs] = metadata.slot_mapping
    batch.seq_lens[:num_seqs] = metadata.seq_lens
    batch.block_tables[:num_seqs, :widest] = metadata.block_table_tensor  # one copy, not one per sequence
    return batch


class CUDAGraphRunner:
    """The decode forward pass over static buffers, one captured graph per batch size in `capture_sizes`; `run` returns
    the logits of the runner's one forward callable, `forward_logits`. `capture=False` runs the same padded path
    eagerly, without graphs: how the CPU tests check the padding (tokens unchanged, the cache untouched by padding
    rows); on a GPU `ModelRunner` always captures."""

    def __init__(
        self, model: LlamaForCausalLM, kv_cache: KVCache, max_num_seqs: int, max_model_len: int, block_size: int,
        forward_logits: ForwardLogits, capture: bool = True,
    ) -> None:
        self.kv_cache, self.forward_logits = kv_cache, forward_logits
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = cdiv(max_model_len, block_size)
        weight = model.model.embed_tokens.weight
        device, rows = weight.device, self.sizes[-1]
        # Static buffers: every graph reads and writes these very tensors (its first rows).
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)  # (N,)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)  # (N,)
        self.slot_mapping = torch.full((rows,), PAD_SLOT_ID, dtype=torch.long, device=device)  # (N,)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)  # (N,)
        self.block_tables = torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=device)  # (N, max_blocks)
        self.rows = torch.arange(rows, device=device)  # (N,) every row is a last row: one token per sequence
        self.output = torch.zeros(rows, model.config.vocab_size, dtype=weight.dtype, device=device)  # (N, V) logits
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0  # steps served by a graph (or, with capture=False, by the padded eager path)
        if capture:
            self.capture()

    def _forward(self, num_rows: int) -> None:
        """The decode forward pass over the first `num_rows` rows of the static buffers."""
        backend = TritonAttentionBackend.for_decode(self.kv_cache, self.slot_mapping[:num_rows],
                                                    self.block_tables[:num_rows], self.seq_lens[:num_rows])
        input_ids, positions = self.input_ids[:num_rows], self.positions[:num_rows]
        self.output[:num_rows] = self.forward_logits(input_ids, positions, self.rows[:num_rows], backend)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first, all in one memory pool (graphs replay one at a time, so
        they can share it). Slots are all PAD_SLOT_ID meanwhile: capturing writes nothing into the cache."""
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: Triton compiles its kernels, the allocator settles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """A pure-decode step (one new token per sequence) that fits the largest graph."""
        num_seqs = len(metadata.block_tables)
        return 0 < num_seqs <= self.sizes[-1] and int(metadata.query_start_loc[-1]) == num_seqs

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Logits (B, V) of a pure-decode step (host inputs), by replaying the graph of its bucket. The result is
        a view of the static output buffer: valid until the next step."""
        num_seqs = input_ids.shape[0]
        size = bucket_for(num_seqs, self.sizes)
        padded = pad_decode_batch(input_ids, positions, metadata, size, self.max_blocks)
        for field in fields(padded):  # each static buffer is named as the padded batch's field it takes
            getattr(self, field.name)[:size].copy_(getattr(padded, field.name), non_blocking=True)
        if size in self.graphs:
            self.graphs[size].replay()
        else:
            with torch.inference_mode():
                self._forward(size)
        self.num_replays += 1
        return self.output[:num_seqs]
