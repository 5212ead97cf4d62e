"""Plausible wrong answers to chapter 09's exercises; each must fail at least one test of its exercise.

Class exercises are mutated by subclassing the reference and overriding the method that goes wrong.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from solutions.core.sched.output import SchedulerOutput
from solutions.distributed import layers
from solutions.distributed.layers import Partition, split_evenly
from solutions.distributed.parallel_state import all_reduce, tp_size
from solutions.executor.worker_proc import WorkerChannel, WorkerProc
from solutions.model.config import ModelConfig
from solutions.worker.model_runner import ModelRunner

# The reference functions, taken when this module is loaded: inside a capstone's `swap_in`, `layers.partition` is
# the mutant itself, and a mutant that deferred to it would only recurse.
reference_partition = layers.partition

# --- partition ----------------------------------------------------------------------------------------------------


def partition_splits_query_heads_evenly(config: ModelConfig, tp_size: int) -> list[Partition]:
    """Splits query heads and K/V heads each as evenly as they go, apart: SmolLM2's 9 query heads become 4 + 5, so
    rank 0's fourth query head belongs to a K/V head it does not hold."""
    return [Partition(q, kv, i, v) for q, kv, i, v in zip(
        split_evenly(config.num_attention_heads, tp_size), split_evenly(config.num_key_value_heads, tp_size),
        split_evenly(config.intermediate_size, tp_size), split_evenly(config.vocab_size, tp_size), strict=True)]


def partition_replicates_kv_heads_round_robin(config: ModelConfig, tp_size: int) -> list[Partition]:
    """Gives rank r the K/V head r % num_kv_heads when ranks outnumber K/V heads, while its query heads are the
    r-th run: with 2 K/V heads over 4 ranks, rank 1's query heads 2, 3 (of K/V head 0) get K/V head 1."""
    kv = config.num_key_value_heads
    if kv >= tp_size:
        return reference_partition(config, tp_size)
    return [Partition(p.q_heads, (r % kv, r % kv + 1), p.intermediate, p.vocab)
            for r, p in enumerate(reference_partition(config, tp_size))]


def partition_drops_the_remainder(config: ModelConfig, tp_size: int) -> list[Partition]:
    """Cuts the vocabulary and the MLP width into tp_size pieces of size total // tp_size: an odd remainder (the
    last token ids, the last hidden units) belongs to no rank."""
    def floor_ranges(total: int) -> list[tuple[int, int]]:
        size = total // tp_size
        return [(r * size, (r + 1) * size) for r in range(tp_size)]

    return [Partition(p.q_heads, p.kv_heads, i, v) for p, i, v in zip(
        reference_partition(config, tp_size), floor_ranges(config.intermediate_size), floor_ranges(config.vocab_size),
        strict=True)]


def partition_never_refuses(config: ModelConfig, tp_size: int) -> list[Partition]:
    """Replicates K/V heads with tp_size // num_kv_heads replicas without checking that it divides: 2 K/V heads
    over 3 ranks hand rank 2 a third K/V head that does not exist, and nothing is raised."""
    kv, group = config.num_key_value_heads, config.num_queries_per_kv
    if kv >= tp_size:
        return reference_partition(config, tp_size)
    replicas = max(1, tp_size // kv)
    kv_ranges = [(r // replicas, r // replicas + 1) for r in range(tp_size)]
    q_ranges = [(h * group + a, h * group + b) for h, _ in kv_ranges[::replicas]
                for a, b in split_evenly(group, replicas)]
    return [Partition(q, k, i, v) for q, k, i, v in zip(
        q_ranges, kv_ranges, split_evenly(config.intermediate_size, tp_size), split_evenly(config.vocab_size, tp_size),
        strict=False)]


def partition_refuses_without_naming_the_option(config: ModelConfig, tp_size: int) -> list[Partition]:
    """Refuses the right splits, with a message that names neither `tensor_parallel_size` nor what would work: the
    user who set the option is left to guess."""
    kv, group = config.num_key_value_heads, config.num_queries_per_kv
    if kv < tp_size and (tp_size % kv or group % (tp_size // kv)):
        raise ValueError(f"cannot split {config.num_attention_heads} query heads over {tp_size} ranks")
    return reference_partition(config, tp_size)


# --- RowParallelLinear --------------------------------------------------------------------------------------------


class RowParallelLinearBiasPerRank(layers.RowParallelLinear):
    """Adds the bias before the all-reduce: every rank adds it, so the sum holds it tp_size times."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(F.linear(x, self.weight, self.bias))


class RowParallelLinearWithoutAllReduce(layers.RowParallelLinear):
    """Returns each rank's partial product as if it were the output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        return out if self.bias is None else out + self.bias


class RowParallelLinearAverages(layers.RowParallelLinear):
    """Averages the partial products over the ranks instead of summing them (as gradients are averaged in data
    parallelism)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(F.linear(x, self.weight)) / tp_size()
        return out if self.bias is None else out + self.bias


class RowParallelLinearReducesToRankZero(layers.RowParallelLinear):
    """Reduces onto rank 0 only (`dist.reduce`): rank 0 gets the sum, the others keep a partial one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.reduce(out, dst=0)
        return out if self.bias is None else out + self.bias


class RowParallelLinearReturnsFloat32(layers.RowParallelLinear):
    """Sums the partial products in float32 for precision, and forgets to cast back: a bf16 model's hidden state
    turns float32 at the first o_proj."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(F.linear(x.float(), self.weight.float()))
        return out if self.bias is None else out + self.bias.float()


# --- VocabParallelEmbedding ---------------------------------------------------------------------------------------


class VocabParallelEmbeddingClampsWithoutMasking(layers.VocabParallelEmbedding):
    """Clamps every token id into this rank's range, and forgets to zero the rows of tokens it does not hold: a
    token is counted once by its rank and again, as the nearest row, by every other rank."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids.clamp(self.vocab_start, self.vocab_end - 1) - self.vocab_start
        return all_reduce(F.embedding(local, self.weight))


class VocabParallelEmbeddingWithoutOffset(layers.VocabParallelEmbedding):
    """Looks a token up at its global id in the rank's local table (no `- vocab_start`)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        rows = F.embedding(torch.where(mine, input_ids, 0), self.weight)
        return all_reduce(rows * mine[:, None].to(rows.dtype))


class VocabParallelEmbeddingWithoutAllReduce(layers.VocabParallelEmbedding):
    """Returns this rank's rows, zeros for the other tokens, without adding the other ranks' rows."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        rows = F.embedding(torch.where(mine, input_ids - self.vocab_start, 0), self.weight)
        return rows * mine[:, None].to(rows.dtype)


class VocabParallelEmbeddingEndInclusive(layers.VocabParallelEmbedding):
    """Treats the range as [start, end]: the first token of the next rank's range is claimed by this rank too, and
    read past the end of its table."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.vocab_start) & (input_ids <= self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0).clamp(max=self.weight.shape[0] - 1)
        rows = F.embedding(local, self.weight)
        return all_reduce(rows * mine[:, None].to(rows.dtype))


class VocabParallelEmbeddingFloatMask(layers.VocabParallelEmbedding):
    """Multiplies by the mask as float32 (`mine.float()`): right in float32, but bf16 rows come back float32."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        rows = F.embedding(torch.where(mine, input_ids - self.vocab_start, 0), self.weight)
        return all_reduce(rows * mine[:, None].float())


# --- execute_model_in_lockstep (rank 0's side of a step) ------------------------------------------------------------


def lockstep_rank_zero_only(model_runner: ModelRunner, workers: list[WorkerProc],
                            scheduler_output: SchedulerOutput) -> torch.Tensor:
    """Runs rank 0's forward pass and sends nothing: the workers wait for a step while rank 0 waits for them in the
    embedding's all-reduce, until the group's timeout."""
    return model_runner.execute_model(scheduler_output)


def lockstep_forward_then_send(model_runner: ModelRunner, workers: list[WorkerProc],
                               scheduler_output: SchedulerOutput) -> torch.Tensor:
    """Runs rank 0's forward pass first and sends the step after it: rank 0's first all-reduce meets workers still
    waiting for the step, and neither side ever gets what it waits for."""
    logits = model_runner.execute_model(scheduler_output)
    for worker in workers:
        worker.send_step(scheduler_output)
    return logits


def lockstep_sends_to_the_first_worker(model_runner: ModelRunner, workers: list[WorkerProc],
                                       scheduler_output: SchedulerOutput) -> torch.Tensor:
    """Sends the step to rank 1 only, as if there were two ranks: over four, ranks 2 and 3 never join the step."""
    workers[0].send_step(scheduler_output)
    return model_runner.execute_model(scheduler_output)


def lockstep_without_naming_the_dead(model_runner: ModelRunner, workers: list[WorkerProc],
                                     scheduler_output: SchedulerOutput) -> torch.Tensor:
    """Sends and runs, and lets gloo's error through as it is: the caller reads "Connection closed by peer" and
    cannot tell that a worker died, nor which."""
    for worker in workers:
        worker.send_step(scheduler_output)
    return model_runner.execute_model(scheduler_output)


def lockstep_swallows_a_failed_step(model_runner: ModelRunner, workers: list[WorkerProc],
                                    scheduler_output: SchedulerOutput) -> torch.Tensor:
    """Catches the failed collective to keep the engine going, and returns no logits: the caller hears nothing of
    the dead worker, and the next thing to break is the sampler, far from the cause."""
    try:
        for worker in workers:
            worker.send_step(scheduler_output)
        return model_runner.execute_model(scheduler_output)
    except RuntimeError:
        return torch.empty(0, model_runner.model.config.vocab_size)


# --- worker_busy_loop (ranks 1..N-1) -------------------------------------------------------------------------------


def worker_receives_but_never_runs(runner: ModelRunner, channel: WorkerChannel) -> None:
    """Receives every step and stops at None, but runs nothing, leaving rank 0 alone in the step's all-reduces (the
    worker thinks only rank 0 computes)."""
    while channel.recv_step() is not None:
        pass


def worker_runs_one_step(runner: ModelRunner, channel: WorkerChannel) -> None:
    """Runs the first step it receives and returns: no loop, so the second step finds the worker gone."""
    scheduler_output = channel.recv_step()
    if scheduler_output is not None:
        runner.execute_model(scheduler_output)


def worker_never_stops(runner: ModelRunner, channel: WorkerChannel) -> None:
    """Skips a `None` step as if it were empty, instead of returning: at shutdown the worker waits for a step that
    never comes, until it is killed."""
    while True:
        scheduler_output = channel.recv_step()
        if scheduler_output is not None:
            runner.execute_model(scheduler_output)


def worker_swallows_step_errors(runner: ModelRunner, channel: WorkerChannel) -> None:
    """Catches a step that raises and goes back to wait for the next step, to keep the worker alive: rank 0, inside
    that step's all-reduce, waits for it for ever (until the group's timeout). A HANG mutant."""
    while (scheduler_output := channel.recv_step()) is not None:
        try:
            runner.execute_model(scheduler_output)
        except Exception:  # noqa: BLE001 — the mistake
            continue


MUTANTS = {
    "partition_splits_query_heads_evenly": {"partition": partition_splits_query_heads_evenly},
    "partition_replicates_kv_heads_round_robin": {"partition": partition_replicates_kv_heads_round_robin},
    "partition_drops_the_remainder": {"partition": partition_drops_the_remainder},
    "partition_never_refuses": {"partition": partition_never_refuses},
    "partition_refuses_without_naming_the_option": {"partition": partition_refuses_without_naming_the_option},
    "row_parallel_linear_bias_per_rank": {"RowParallelLinear": RowParallelLinearBiasPerRank},
    "row_parallel_linear_without_all_reduce": {"RowParallelLinear": RowParallelLinearWithoutAllReduce},
    "row_parallel_linear_averages": {"RowParallelLinear": RowParallelLinearAverages},
    "row_parallel_linear_reduces_to_rank_zero": {"RowParallelLinear": RowParallelLinearReducesToRankZero},
    "row_parallel_linear_returns_float32": {"RowParallelLinear": RowParallelLinearReturnsFloat32},
    "vocab_parallel_embedding_clamps_without_masking": {
        "VocabParallelEmbedding": VocabParallelEmbeddingClampsWithoutMasking,
    },
    "vocab_parallel_embedding_without_offset": {"VocabParallelEmbedding": VocabParallelEmbeddingWithoutOffset},
    "vocab_parallel_embedding_without_all_reduce": {"VocabParallelEmbedding": VocabParallelEmbeddingWithoutAllReduce},
    "vocab_parallel_embedding_end_inclusive": {"VocabParallelEmbedding": VocabParallelEmbeddingEndInclusive},
    "vocab_parallel_embedding_float_mask": {"VocabParallelEmbedding": VocabParallelEmbeddingFloatMask},
    "lockstep_rank_zero_only": {"execute_model_in_lockstep": lockstep_rank_zero_only},
    "lockstep_forward_then_send": {"execute_model_in_lockstep": lockstep_forward_then_send},
    "lockstep_sends_to_the_first_worker": {"execute_model_in_lockstep": lockstep_sends_to_the_first_worker},
    "lockstep_without_naming_the_dead": {"execute_model_in_lockstep": lockstep_without_naming_the_dead},
    "lockstep_swallows_a_failed_step": {"execute_model_in_lockstep": lockstep_swallows_a_failed_step},
    "worker_receives_but_never_runs": {"worker_busy_loop": worker_receives_but_never_runs},
    "worker_runs_one_step": {"worker_busy_loop": worker_runs_one_step},
    "worker_never_stops": {"worker_busy_loop": worker_never_stops},
    "worker_swallows_step_errors": {"worker_busy_loop": worker_swallows_step_errors},
}

# One mutant per exercise that must also break the capstone (the capstone runs every piece).
CAPSTONE_MUTANTS = {
    "partition": "partition_splits_query_heads_evenly",
    "RowParallelLinear": "row_parallel_linear_without_all_reduce",
    "VocabParallelEmbedding": "vocab_parallel_embedding_clamps_without_masking",
    "execute_model_in_lockstep": "lockstep_rank_zero_only",
    "worker_busy_loop": "worker_runs_one_step",
}

# The statements each exercise's question is about, as `ast.unparse` writes them (a compound statement by its
# header). Hint 2 may show none of them, and nothing under chapters/ may state them (tests/test_hints.py): they
# live here, beside the wrong answers, because a learner reads the chapter's test file.
DECISIVE = {
    "partition": [
        'replicas = tp_size // kv',
        'kv_ranges = [(r // replicas, r // replicas + 1) for r in range(tp_size)]',
        'if tp_size % kv or group % (tp_size // kv):',
    ],
    "RowParallelLinear": [
        'out = all_reduce(F.linear(x, self.weight))',
        'return out if self.bias is None else out + self.bias',
    ],
    "VocabParallelEmbedding": [
        'mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)',
        'return all_reduce(rows * mine[:, None].to(rows.dtype))',
    ],
    "execute_model_in_lockstep": [
        'worker.send_step(scheduler_output)',
        'return model_runner.execute_model(scheduler_output)',
    ],
    "worker_busy_loop": [
        'while (scheduler_output := channel.recv_step()) is not None:',
    ],
}
