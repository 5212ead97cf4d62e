"""Turn one scheduled step into one flat forward pass, then sample the step's tokens from its logits.

The step's tokens (whole prompts, prompt chunks and single decode tokens alike) are concatenated into one flat
batch of T tokens, with per-token metadata (position, cache slot) and per-sequence metadata (where its rows start,
its context length, its block table); no padding. Sequence b's new tokens are `token_ids[c_b : c_b + n_b]`, where
`c_b` is the step's `num_computed_tokens[b]`, kept by the scheduler. The metadata is built on the host and copied
to where the weights and the KV cache are. Unless `enforce_eager`, pure-decode steps on a GPU with the Triton
backend replay CUDA graphs (`cuda_graph.py`) and the CPU's inductor backend runs one compiled graph
(`compiled_forward.py`).

The runner samples too, as vLLM's does: `execute_model` keeps the logits of the rows that sample
(`sampling_rows`), and `sample_tokens` masks them by the step's grammars and draws one token per sampling sequence
with its own parameters and generator — the engine core never touches logits. A request with `prompt_logprobs`
also runs the LM head on its prompt chunk's rows (the logits at position i score prompt token i + 1); its prompt
is never read from the prefix cache (`skip_reading_prefix_cache`, as vLLM), so every position is computed here.

Speculative decoding: a sequence with k drafts (`scheduled_spec_decode_tokens`) is fed its newest token and its
drafts, and the LM head runs on all k + 1 rows (row j scores draft j). `sample_tokens` verifies the whole batch
with `rejection_sample`, after each row's logit bias and penalties over the tokens before it, and gives each
sequence its accepted drafts and one more token. Then the proposer (`solutions.spec_decode.Proposer`) drafts the
next tokens, which the engine core takes (`take_draft_token_ids`) for the scheduler's next step.

Where this lives in vLLM: `vllm/v1/worker/gpu_model_runner.py` (`_prepare_inputs`, `execute_model`,
`sample_tokens`, `propose_draft_token_ids`, `take_draft_token_ids`).
"""

import itertools
import time
from typing import TYPE_CHECKING

import torch

from solutions.attention.backend import AttentionBackend
from solutions.attention.paged import AttentionMetadata, KVCache, copy_blocks
from solutions.attention.registry import get_attention_backend
from solutions.config import SpeculativeConfig, VllmConfig
from solutions.core.block_manager import slot_mapping
from solutions.core.sched.output import DraftTokenIds, GrammarOutput, ModelRunnerOutput, SchedulerOutput, sampling_rows
from solutions.core.sequence import Sequence
from solutions.kv_offload.transfer import KVTransfer, allocate_host_cache
from solutions.model.llama import LlamaForCausalLM
from solutions.outputs import PromptLogprobsChunk
from solutions.sample.rejection_sampler import rejection_sample
from solutions.sample.sampler import gather_logprobs, process_logits, sample
from solutions.spec_decode import PerSequenceProposer, Proposer
from solutions.spec_decode.draft_model import DraftModelProposer
from solutions.spec_decode.ngram_proposer import NgramProposer
from solutions.structured_output.bitmask import apply_token_bitmask
from solutions.worker.block_table import BlockTable

if TYPE_CHECKING:  # the graph runner imports Triton: only on a GPU
    from solutions.worker.cuda_graph import ForwardLogits


def prepare_inputs(
    scheduler_output: SchedulerOutput, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """input_ids (T,), positions (T,) and the attention metadata of the step's scheduled tokens, concatenated."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens = []
    for seq, start, num_new in zip(
        scheduler_output.scheduled_seqs, scheduler_output.num_computed_tokens, scheduler_output.num_scheduled_tokens,
        strict=True,
    ):
        end = start + num_new
        input_ids += seq.token_ids[start:end] + scheduler_output.scheduled_spec_decode_tokens.get(seq.seq_id, [])
        positions += range(start, end)
        slots += slot_mapping(seq.block_table, start, end, block_size)
        query_start_loc.append(query_start_loc[-1] + num_new)
        seq_lens.append(end)  # the context each new token may see ends with the last new token
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.long),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long),
        block_tables=[seq.block_table for seq in scheduler_output.scheduled_seqs],
    )
    return torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), metadata


def prompt_logprobs_rows(scheduler_output: SchedulerOutput) -> tuple[list[int], list[tuple[int, int, list[int], int]]]:
    """The flat-batch rows whose logits give prompt logprobs this step, and per such sequence (seq_id, the prompt
    position its first logprob is for, the prompt tokens those rows predict, its `prompt_logprobs`).

    A chunk of positions [start, end) of a prompt of P tokens predicts prompt tokens start + 1 .. min(end, P - 1):
    a chunk that ends the prompt predicts the first output token with its last row, which is not a prompt
    logprob. Only sequences still on their first prompt pass (no output token yet) qualify: a resumed one
    already delivered them.
    """
    rows: list[int] = []
    chunks: list[tuple[int, int, list[int], int]] = []
    offset = 0
    for seq, start, num_new in zip(
        scheduler_output.scheduled_seqs, scheduler_output.num_computed_tokens, scheduler_output.num_scheduled_tokens,
        strict=True,
    ):
        params = seq.sampling_params
        if params is not None and params.prompt_logprobs is not None and seq.num_output_tokens == 0:
            end = min(start + num_new, seq.num_prompt_tokens - 1)  # rows start .. end - 1 predict prompt tokens
            if end > start:
                rows += range(offset, offset + end - start)
                chunks.append((seq.seq_id, start + 1, seq.token_ids[start + 1 : end + 1], params.prompt_logprobs))
        offset += num_new
    return rows, chunks


def draft_rows(scheduler_output: SchedulerOutput) -> list[int]:
    """The flat-batch rows that score draft tokens: for each sequence with k drafts, in batch order, the k rows
    before its last (its newest token's, then its drafts but the last)."""
    rows: list[int] = []
    end = 0
    for seq, num_new in zip(scheduler_output.scheduled_seqs, scheduler_output.num_scheduled_tokens, strict=True):
        end += num_new
        num_drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(seq.seq_id, []))
        rows += range(end - 1 - num_drafts, end - 1)
    return rows


def compute_prompt_logprobs(
    prompt_logits: torch.Tensor, chunks: list[tuple[int, int, list[int], int]]
) -> dict[int, PromptLogprobsChunk]:
    """Each chunk's prompt logprobs from the logits (E, V) of `prompt_logprobs_rows`' rows, in their order: the
    raw model's log-softmax, the top `prompt_logprobs` tokens and the actual prompt token's (logprob, rank)."""
    if not chunks:
        return {}
    targets = [token_id for chunk in chunks for token_id in chunk[2]]
    num_logprobs = [chunk[3] for chunk in chunks for _ in chunk[2]]
    gathered = gather_logprobs(torch.log_softmax(prompt_logits.float(), dim=-1), targets, num_logprobs)
    result, start = {}, 0
    for seq_id, position, chunk_targets, _ in chunks:
        result[seq_id] = position, gathered[start : start + len(chunk_targets)]
        start += len(chunk_targets)
    return result


def build_drafter(model: LlamaForCausalLM, config: SpeculativeConfig) -> Proposer:
    """The proposer of `config.method`: the n-gram one looped over the batch, or the target's first layers."""
    if config.method == "draft_model":
        return DraftModelProposer(model, config.num_draft_layers, config.num_speculative_tokens)
    ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens)
    return PerSequenceProposer(ngram)


class ModelRunner:
    """Owns the model and the paged KV cache (on the model's device, in its dtype); one `execute_model` call is one
    forward pass. Unless `enforce_eager`, the forward pass is compiled (`self.compiled_forward`) on the devices the
    attention backend names (`compiles_on`), and on a GPU CUDA graphs of it are captured for pure-decode steps when
    `max_num_seqs` and `max_model_len` are given (`self.cuda_graphs`, else None).
    """

    def __init__(
        self, model: LlamaForCausalLM, num_blocks: int, block_size: int, attention_backend: str = "torch", *,
        enforce_eager: bool = False, max_num_seqs: int | None = None, max_model_len: int | None = None,
        speculative_config: SpeculativeConfig | None = None, num_swap_blocks: int = 0, num_offload_blocks: int = 0,
    ) -> None:
        self.backend_cls = get_attention_backend(attention_backend)  # built once per step
        self.model, self.block_size = model, block_size
        # the sampling rows' logits, their sequences, the step's times, its prompt logprobs' logits and chunks, and
        # each sequence's drafts (None in a step without drafts)
        self._pending: tuple[torch.Tensor, list, dict[str, float], tuple[torch.Tensor, list], list | None] | None = None
        self.drafter = None if speculative_config is None else build_drafter(model, speculative_config)
        self._draft_token_ids: DraftTokenIds | None = None  # the last sampling's drafts, until taken
        weight = model.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.kv_cache = KVCache.allocate(
            model.config, num_blocks, block_size, dtype=self.dtype, device=self.device,
            sliding_windows=model.config.sliding_windows,
        )
        # chapter 11: host memory for swapped-out sequences and for the prefix cache's second tier (None: off)
        self.swap_cache, self.offload_cache = (
            allocate_host_cache(model.config, n, block_size, self.dtype, self.device) if n else None
            for n in (num_swap_blocks, num_offload_blocks)
        )
        self.kv_transfer = KVTransfer(self.device)  # their copies: on a stream of their own on a GPU
        # the step's block tables as kernels take them, kept from step to step: a step writes only what changed
        self.block_table = BlockTable(block_size, max_num_seqs or 8, max_model_len or 256)
        self.cuda_graphs = None
        self.compiled_forward = None
        if self.device.type in self.backend_cls.compiles_on and not enforce_eager:
            from solutions.worker.compiled_forward import CompiledForward

            self.compiled_forward = CompiledForward(model)  # on a GPU: about 10 kernels a layer in place of 44
            self.warm_up()
            if self.device.type == "cuda" and max_num_seqs and max_model_len:
                from solutions.worker.cuda_graph import CUDAGraphRunner  # imports Triton: only when asked

                self.cuda_graphs = CUDAGraphRunner(model, self.kv_cache, max_num_seqs, max_model_len, block_size,
                                                   self.forward_logits)

    @classmethod
    def from_config(cls, model: LlamaForCausalLM, vllm_config: VllmConfig, **overrides: object) -> "ModelRunner":
        model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
        options = dict(
            num_blocks=cache_config.num_kv_blocks, block_size=cache_config.block_size,
            attention_backend=model_config.attention_backend, enforce_eager=model_config.enforce_eager,
            max_num_seqs=vllm_config.scheduler_config.max_num_seqs, max_model_len=model_config.max_model_len,
            speculative_config=vllm_config.speculative_config,
            num_swap_blocks=cache_config.num_swap_blocks if cache_config.swapping else 0,
            num_offload_blocks=cache_config.num_offload_blocks,
        )
        return cls(model, **(options | overrides))

    def execute_model(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        """Make the step's copies to and from host memory and its copy-on-write copies, write the new tokens' K/V,
        and return the logits (B, V) at each scheduled sequence's last scheduled token (meaningless for a prompt
        chunk that is not the last); the rows that sample, and the rows scoring draft tokens, are kept for
        `sample_tokens`.

        Changes no sequence (the scheduler advanced them when it scheduled the step).
        """
        seconds = {"prepare": 0.0, "forward": 0.0}
        self.transfer_blocks(scheduler_output)  # even in a step that schedules nobody: it may swap a group out
        if not scheduler_output.scheduled_seqs:
            empty = torch.empty(0, self.model.config.vocab_size)  # (0, V)
            self._pending = empty, [], seconds, (empty, []), None
            return empty
        extra_rows, prompt_chunks = prompt_logprobs_rows(scheduler_output)  # none unless a request asks
        spec_rows = draft_rows(scheduler_output) if scheduler_output.scheduled_spec_decode_tokens else []
        extra_rows += spec_rows
        logits = self.forward(scheduler_output, seconds, torch.tensor(extra_rows) if extra_rows else None)
        num_seqs, num_prompt_rows = len(scheduler_output.scheduled_seqs), len(extra_rows) - len(spec_rows)
        prompt_logits = logits[num_seqs : num_seqs + num_prompt_rows]  # (E, V)
        rows, seqs = sampling_rows(scheduler_output)
        drafts = None
        if spec_rows:  # each sampling sequence's rows: its draft rows (after the prompt logprobs' rows), its last
            spec = scheduler_output.scheduled_spec_decode_tokens
            drafts = [spec.get(seq.seq_id, []) for seq in seqs]
            rows_of_drafts, offset = {}, num_seqs + num_prompt_rows  # seq_id -> the rows of its drafts
            for seq in scheduler_output.scheduled_seqs:
                rows_of_drafts[seq.seq_id] = range(offset, offset + len(spec.get(seq.seq_id, [])))
                offset += len(rows_of_drafts[seq.seq_id])
            # a sample forked this step has no drafts (it shares its parent's last row)
            rows = [r for row, seq in zip(rows, seqs, strict=True) for r in [*rows_of_drafts.get(seq.seq_id, []), row]]
        # (N, V), N = the sampling sequences' drafts + 1 each: rows may repeat (n > 1 forks share one)
        self._pending = logits[rows], seqs, seconds, (prompt_logits, prompt_chunks), drafts
        return logits[:num_seqs]

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """One token per sampling row of the last `execute_model`, within its grammar's mask if it has one; with
        drafts, each sequence's accepted drafts then one token. Then the next drafts, with speculation on."""
        if self._pending is None:
            raise RuntimeError("sample_tokens() needs an execute_model() first: there are no logits to sample from")
        logits, seqs, seconds, (prompt_logits, prompt_chunks), drafts = self._pending
        self._pending = None
        start = time.perf_counter()
        if drafts is not None:
            if grammar_output is not None:
                raise RuntimeError("draft tokens are not checked against grammars: structured outputs run unspeculated")
            sampled_token_ids, logprobs = self._verify(logits, seqs, drafts)
        else:
            if grammar_output is not None:  # structured outputs: only what the grammars allow
                logits = apply_token_bitmask(logits, grammar_output.bitmask())  # (N, V), the mask (N, W)
            sampled = sample(
                logits, [seq.sampling_params for seq in seqs], [seq.generator for seq in seqs],
                [seq.token_ids for seq in seqs], [seq.num_prompt_tokens for seq in seqs],
                self.model.config.eos_token_id,
            )
            sampled_token_ids = [[token_id] for token_id in sampled.sampled_token_ids]
            logprobs = [
                None if top is None else [(top, chosen)]
                for top, chosen in zip(sampled.logprobs, sampled.sampled_logprobs, strict=True)
            ]
        seq_ids = [seq.seq_id for seq in seqs]
        if self.drafter is not None:  # from each sequence's tokens after this step
            self._draft_token_ids = DraftTokenIds(seq_ids, self.drafter.propose_draft_token_ids(
                seq_ids, [seq.token_ids + new for seq, new in zip(seqs, sampled_token_ids, strict=True)]
            ))
        seconds["sample"] = time.perf_counter() - start
        return ModelRunnerOutput(seq_ids, sampled_token_ids, logprobs, seconds,
                                 compute_prompt_logprobs(prompt_logits, prompt_chunks))

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts proposed after the last sampling (None without speculation, or once taken)."""
        draft_token_ids, self._draft_token_ids = self._draft_token_ids, None
        return draft_token_ids

    def _verify(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]
    ) -> tuple[list[list[int]], list[list[tuple[list[tuple[int, float]], tuple[float, int]]] | None]]:
        """Verify a step's drafts: each sequence's new tokens (its accepted drafts, then one) and, where asked,
        their logprobs. logits (sum_i (k_i + 1), V): sequence i's k_i draft rows, then its last row."""
        params, row_params, row_prompt = [seq.sampling_params for seq in seqs], [], []
        for seq, draft in zip(seqs, drafts, strict=True):
            row_params += [seq.sampling_params] * (len(draft) + 1)
            row_prompt += [seq.num_prompt_tokens] * (len(draft) + 1)
        row_tokens = None  # row j of a sequence sees its tokens and its first j drafts: only bias and penalties read it
        if any(p.has_logit_bias or p.has_penalties for p in params):
            row_tokens = [seq.token_ids + draft[:j] for seq, draft in zip(seqs, drafts) for j in range(len(draft) + 1)]
        processed = process_logits(logits, row_params, row_tokens, row_prompt, self.model.config.eos_token_id)
        sampled_token_ids = rejection_sample(processed, drafts, params, [seq.generator for seq in seqs])
        logprobs: list = [None] * len(seqs)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:  # the target's raw logprobs at the rows whose tokens were kept
            first_row = [0, *itertools.accumulate(len(draft) + 1 for draft in drafts)]
            rows = [first_row[i] + j for i in wanted for j in range(len(sampled_token_ids[i]))]
            gathered = gather_logprobs(
                torch.log_softmax(logits[rows].float(), dim=-1), [t for i in wanted for t in sampled_token_ids[i]],
                [params[i].logprobs for i in wanted for _ in sampled_token_ids[i]],
            )
            for i in wanted:
                logprobs[i], gathered = gathered[: len(sampled_token_ids[i])], gathered[len(sampled_token_ids[i]) :]
        return sampled_token_ids, logprobs

    @property
    def forward_logits(self) -> "ForwardLogits":
        """The step's one forward callable, logits (B, V) at the last rows: the compiled forward pass, or the eager
        model and its LM head (`enforce_eager`, or a device the backend does not compile on)."""
        return self._eager_logits if self.compiled_forward is None else self.compiled_forward

    def _eager_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, last_rows: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, backend)[last_rows])  # (B, V)

    def forward(
        self, scheduler_output: SchedulerOutput, seconds: dict[str, float] | None = None,
        extra_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The forward pass itself: the logits (B, V) at each scheduled sequence's last scheduled token, then at
        `extra_rows` (E,) of the flat batch if given ((B + E, V) in all). `seconds` gets the time spent preparing
        the inputs ("prepare") and in the model ("forward")."""
        start = time.perf_counter()
        input_ids, positions, metadata = prepare_inputs(scheduler_output, self.block_size)  # on the host
        self.kv_transfer.wait()  # the step's swaps and loads have landed: from here on the device cache is read
        if scheduler_output.blocks_to_copy:
            copy_blocks(self.kv_cache, scheduler_output.blocks_to_copy)
        metadata.block_table_tensor = self.block_table.update(scheduler_output)  # (B, max_blocks), not from the lists
        last_rows = metadata.query_start_loc[1:] - 1  # (B,) row of each sequence's last new token
        if extra_rows is not None:
            last_rows = torch.cat([last_rows, extra_rows])  # (B + E,)
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(metadata):  # a pure decode: replay
            prepared = time.perf_counter()
            logits = self.cuda_graphs.run(input_ids, positions, metadata)[last_rows]  # B == T rows: (B, V)
        else:
            backend = self.backend_cls(self.kv_cache, metadata)  # copies the metadata it needs to the device
            input_ids, positions = input_ids.to(self.device), positions.to(self.device)  # (T,), (T,)
            prepared = time.perf_counter()
            logits = self.forward_logits(input_ids, positions, last_rows.to(self.device), backend)  # (B, V)
        if seconds is not None:
            seconds["prepare"] += prepared - start
            seconds["forward"] += time.perf_counter() - prepared
        return logits

    def transfer_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """Chapter 11's copies between the device cache and host memory, in the order the scheduler relies on: the
        stores and swap-outs read device blocks before the swap-ins and loads (and then copy-on-write and the
        forward pass) may write over them — a block freed by one of them can be handed out again in the same step.
        One batched copy per direction and cache tensor each; on a GPU they are issued on the transfer stream, and
        `forward` waits for them after preparing the step's inputs."""
        out = scheduler_output
        self.kv_transfer.start([
            (self.kv_cache, self.offload_cache, out.blocks_to_store),
            (self.kv_cache, self.swap_cache, out.blocks_to_swap_out),
            (self.swap_cache, self.kv_cache, out.blocks_to_swap_in),
            (self.offload_cache, self.kv_cache, out.blocks_to_load),
        ])

    def warm_up(self) -> None:
        """Compile before the first request, as vLLM does at start-up: a step with a prefill of two tokens beside a
        prefill of one (T != B, so the graph does not tie the two sizes), then a decode step. The dummy tokens go to the
        first slots of block 0, a free block, whose contents are overwritten before they are read."""
        steps = [  # (token slots, query_start_loc, seq_lens, block tables)
            ([0, 1, 16], [0, 2, 3], [2, 1], [[0], [1]]),
            ([2, 17], [0, 1, 2], [3, 2], [[0], [1]]),
        ]
        for slots, starts, seq_lens, tables in steps:
            metadata = AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts),
                                         seq_lens=torch.tensor(seq_lens), block_tables=tables)
            positions = torch.cat([torch.arange(n - (e - s), n) for s, e, n in zip(starts, starts[1:], seq_lens)])
            input_ids = torch.zeros(len(slots), dtype=torch.long, device=self.device)
            backend = self.backend_cls(self.kv_cache, metadata)
            last_rows = (metadata.query_start_loc[1:] - 1).to(self.device)
            self.compiled_forward(input_ids, positions.to(self.device), last_rows, backend)
