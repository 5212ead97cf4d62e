"""How much reserved KV memory holds tokens: contiguous reservation (Orca-style) against paged blocks.

A serving simulation without a model: it drives the reference `BlockManager` and `ContiguousAllocator` over
the ShareGPT-like workload of `benchmarks/workload.py` and counts token slots. Run it:

    python -m benchmarks.memory            # table
    python -m benchmarks.memory --json     # one JSON object; utilisation as fractions in [0, 1]

The simulated engine, one step at a time:
- Arrivals: all requests are queued at step 0 (an offline batch), so the waiting queue stays non-empty and
  memory, not arrivals, limits the batch — the regime where the allocator decides how many requests run.
- Admission: FCFS; the head of the queue is admitted when memory allows, otherwise nobody behind it is (no
  overtaking), at most `max_num_seqs` (vLLM's default, 256) at once. Contiguous: the head's whole reservation
  (`reserved_length`) must fit in one hole (first fit). Paged: blocks for the prompt (`can_allocate`).
- Each step every running request gets one token. Paged requests need one new block when a token starts a
  block; when none is free, the newest running request is preempted by recompute (its blocks freed, back to
  the front of the queue, re-prefilled later), as vLLM's scheduler does. Contiguous requests never grow.
- A request finishes when it has its `output_len` tokens and frees its memory at once.

Metrics, measured over the saturated steps (requests still waiting) after a warm-up (the first 20% of them,
where the batch is still the initial burst of fresh prompts):
- utilisation = tokens stored / slots reserved (contiguous) or allocated (paged, blocks × block_size), averaged
  over steps. Holes between reservations are not in the denominator; `pool_utilization` (tokens / all slots)
  charges them too, which is what the paper's Fig. 2 plots.
- the mean and peak number of requests held at once.

Expected values: over a long saturated run each request contributes its lifetime sums (renewal-reward), so
expected utilisation = Σ_requests Σ_steps stored / Σ_requests Σ_steps reserved, with stored tokens going
p, p+1, …, p+L−1 over the L steps a request with prompt p and output L is held. For paged blocks that ratio is
the limit `paged_limit`: only the unused slots of each request's last block are lost. A full pool then holds
on average num_slots × Σ L / Σ reserved requests, which gives the expected concurrency ratios.

Why our contiguous numbers differ from the paper's Fig. 2 (Orca Max 20.4%, Pow2 26.8%, Oracle 38.2%): the
paper's percentages are of all KV memory, including 8.9–41.6% "external fragmentation and others" from a buddy
allocator under a one-hour trace with Poisson arrivals. Leaving that share out, its token shares become
22.4%, 45.9% and 60.3%, which is what our `utilization` measures; our `pool_utilization` includes our own
first-fit holes. Our lengths are a lognormal fit to two means, not the trace itself. The paper's batched-request
ratios (Fig. 13a: vLLM holds 2.2× Orca (Oracle), 4.3× Orca (Max)) come from OPT-13B at 2 requests/s; our
"expected" ratios ignore external fragmentation, which shrinks the contiguous batch further in the simulation.

What paging costs here: with nothing reserved for future tokens, a full pool runs out of blocks as requests
grow, and the newest requests are preempted and later recomputed. The table counts those preemptions and the
tokens prefilled again; chapter 5's scheduler meets the same situation with a model.
"""

import argparse
import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.workload import MAX_MODEL_LEN, Request, describe, sharegpt_like_requests
from solutions.core.block_manager import BlockManager
from solutions.baselines.contiguous_allocator import ContiguousAllocator, ReservationPolicy, reserved_length
from solutions.core.sequence import Sequence, SequenceStatus

NUM_REQUESTS = 1000
NUM_SLOTS = 16 * MAX_MODEL_LEN  # KV budget: 32768 token slots, 16 max-length requests (paper, OPT-13B: 15.7K)
MAX_NUM_SEQS = 256  # vLLM's default cap on running requests
BLOCK_SIZES = (8, 16, 32, 64, 128)
WARMUP_FRACTION = 0.2
CONTIGUOUS_POLICIES = {
    "contiguous_max": ReservationPolicy.MAX_MODEL_LEN,
    "contiguous_pow2": ReservationPolicy.POW2,
    "contiguous_oracle": ReservationPolicy.ORACLE,
}
# vLLM paper Fig. 2, % of KV memory: (token states, reservation, internal frag., external frag. & others)
PAPER_FIG2 = {
    "contiguous_max": (20.4, 13.3, 57.3, 8.9),
    "contiguous_pow2": (26.8, 17.9, 13.6, 41.6),
    "contiguous_oracle": (38.2, 25.2, 0.0, 36.6),
}
PAPER_VLLM_UTILIZATION = 0.963  # Fig. 2
PAPER_BATCHED_RATIO = {"contiguous_oracle": 2.2, "contiguous_max": 4.3}  # Fig. 13a, vLLM ÷ Orca


@dataclass
class SimResult:
    """Per-step traces of one simulation (for plots) and the metrics over its measured window."""

    name: str
    num_slots: int
    stored: list[int] = field(default_factory=list)  # tokens whose K/V are held, per step
    reserved: list[int] = field(default_factory=list)  # slots reserved or allocated, per step
    num_running: list[int] = field(default_factory=list)  # requests holding memory, per step
    saturated: list[bool] = field(default_factory=list)  # requests were still waiting, per step
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # tokens prefilled again after a preemption: the price of paging this way

    @property
    def window(self) -> tuple[int, int]:
        """Measured steps [first, last): the saturated phase without its warm-up."""
        last = self.saturated.index(False)
        if last == 0:
            raise ValueError(f"{self.name}: every request fit at once, so memory never limited the batch")
        return int(last * WARMUP_FRACTION), last

    def _mean(self, values: list[float]) -> float:
        first, last = self.window
        return sum(values[first:last]) / (last - first)

    @property
    def utilization(self) -> float:
        return self._mean([s / r if r else 0.0 for s, r in zip(self.stored, self.reserved)])

    @property
    def pool_utilization(self) -> float:
        return self._mean(self.stored) / self.num_slots

    @property
    def mean_concurrent(self) -> float:
        return self._mean(self.num_running)

    @property
    def max_concurrent(self) -> int:
        first, last = self.window
        return max(self.num_running[first:last])

    def record(self, running: list[Sequence], reserved: int, num_waiting: int) -> None:
        self.stored.append(sum(seq.num_tokens for seq in running))
        self.reserved.append(reserved)
        self.num_running.append(len(running))
        self.saturated.append(num_waiting > 0)


def _check_fits(request_id: int, running: list[Sequence], num_slots: int) -> None:
    if not running:  # nothing will ever be freed: the request can never run
        raise ValueError(f"request {request_id} does not fit in an empty pool of {num_slots} slots")


def simulate_contiguous(
    requests: list[Request],
    policy: ReservationPolicy,
    num_slots: int = NUM_SLOTS,
    max_model_len: int = MAX_MODEL_LEN,
    max_num_seqs: int = MAX_NUM_SEQS,
) -> SimResult:
    """Serve `requests` with one contiguous reservation each, chosen by `policy`."""
    allocator = ContiguousAllocator(num_slots)
    result = SimResult(policy.name, num_slots)
    waiting = deque(requests)
    running: list[Sequence] = []
    output_len: dict[int, int] = {}
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            request = waiting[0]
            num_reserved = reserved_length(request.prompt_len, request.output_len, max_model_len, policy)
            if not allocator.can_allocate(num_reserved):
                _check_fits(request.request_id, running, num_slots)
                break
            allocator.allocate(request.request_id, num_reserved)
            waiting.popleft()
            running.append(Sequence(request.request_id, [0] * request.prompt_len))
            output_len[request.request_id] = request.output_len
        result.record(running, allocator.num_used_slots, len(waiting))
        for seq in running:  # the step's forward pass: one new token each
            seq.append_token(0)
            if seq.num_output_tokens == output_len[seq.seq_id]:
                allocator.free(seq.seq_id)
        running = [seq for seq in running if seq.num_output_tokens < output_len[seq.seq_id]]
    return result


def simulate_paged(
    requests: list[Request],
    block_size: int,
    num_slots: int = NUM_SLOTS,
    max_num_seqs: int = MAX_NUM_SEQS,
    on_step: Callable[[BlockManager, list[Sequence]], None] | None = None,
) -> SimResult:
    """Serve `requests` with a `BlockManager` of `num_slots // block_size` blocks.

    `on_step(manager, running)`, if given, sees the allocator after each step's allocations, before the
    step's tokens are appended (chapter 3 draws its picture of who owns which block from it).
    """
    manager = BlockManager(num_blocks=num_slots // block_size, block_size=block_size)
    result = SimResult(f"PAGED_{block_size}", manager.num_blocks * block_size)
    waiting = deque(Sequence(r.request_id, [0] * r.prompt_len) for r in requests)
    output_len = {r.request_id: r.output_len for r in requests}
    running: list[Sequence] = []  # in admission order: the newest is preempted first
    while waiting or running:
        num_preempted = 0
        i = 0
        while i < len(running):  # decodes first: room for each running request's newest token
            seq = running[i]
            if manager.can_append_slot(seq):
                manager.append_slot(seq)
                i += 1
                continue
            victim = running.pop()  # may be `seq` itself, which ends the loop
            manager.free(victim)
            victim.status, victim.num_computed_tokens = SequenceStatus.PREEMPTED, 0
            waiting.appendleft(victim)
            num_preempted += 1
            result.num_recomputed_tokens += victim.num_tokens
        result.num_preemptions += num_preempted
        while not num_preempted and waiting and len(running) < max_num_seqs:  # then admit, FCFS
            if not manager.can_allocate(waiting[0]):
                _check_fits(waiting[0].seq_id, running, num_slots)
                break
            seq = waiting.popleft()
            manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            running.append(seq)
        result.record(running, manager.num_used_blocks * block_size, len(waiting))
        if on_step is not None:
            on_step(manager, running)
        for seq in running:
            seq.append_token(0)
            if seq.num_output_tokens == output_len[seq.seq_id]:
                manager.free(seq)
                seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        running = [seq for seq in running if seq.status is SequenceStatus.RUNNING]
    return result


# expected values -----------------------------------------------------------------------------------------------


def _stored_sum(request: Request) -> int:
    """Σ over the request's held steps of its stored tokens: p + (p+1) + … + (p+L−1)."""
    p, num_steps = request.prompt_len, request.output_len
    return num_steps * p + num_steps * (num_steps - 1) // 2


def _paged_allocated_sum(request: Request, block_size: int) -> int:
    """Σ over the held steps of block_size × cdiv(tokens, block_size), in closed form."""

    def blocks_prefix_sum(m: int) -> int:  # Σ_{n=1..m} cdiv(n, block_size)
        q, r = divmod(m, block_size)
        return block_size * q * (q + 1) // 2 + r * (q + 1)

    p, num_steps = request.prompt_len, request.output_len
    return block_size * (blocks_prefix_sum(p + num_steps - 1) - blocks_prefix_sum(p - 1))


def expected_utilization(
    requests: list[Request], policy: ReservationPolicy | int, max_model_len: int = MAX_MODEL_LEN
) -> float:
    """Long-run utilisation without external fragmentation; `policy` is a contiguous policy or a block size."""
    stored = sum(_stored_sum(r) for r in requests)
    return stored / _reserved_sum(requests, policy, max_model_len)


def expected_mean_concurrent(
    requests: list[Request], policy: ReservationPolicy | int, num_slots: int, max_model_len: int = MAX_MODEL_LEN
) -> float:
    """Requests a full pool holds on average: num_slots × (steps held) / (slot-steps reserved)."""
    return num_slots * sum(r.output_len for r in requests) / _reserved_sum(requests, policy, max_model_len)


def _reserved_sum(requests: list[Request], policy: ReservationPolicy | int, max_model_len: int) -> int:
    """Σ over requests and held steps of the slots reserved (contiguous policy) or allocated (block size)."""
    if isinstance(policy, ReservationPolicy):
        return sum(reserved_length(r.prompt_len, r.output_len, max_model_len, policy) * r.output_len for r in requests)
    return sum(_paged_allocated_sum(r, policy) for r in requests)


# report --------------------------------------------------------------------------------------------------------


def run_all(requests: list[Request], block_size: int = 16, num_slots: int = NUM_SLOTS) -> dict[str, SimResult]:
    """Every contiguous policy, then paged at each of `BLOCK_SIZES` (keys "paged_8", …) and `block_size`."""
    results = {name: simulate_contiguous(requests, policy, num_slots) for name, policy in CONTIGUOUS_POLICIES.items()}
    for size in sorted({*BLOCK_SIZES, block_size}):
        results[f"paged_{size}"] = simulate_paged(requests, size, num_slots)
    results["paged"] = results[f"paged_{block_size}"]
    return results


def summary(requests: list[Request], results: dict[str, SimResult], block_size: int) -> dict:
    """The JSON object printed by `--json`; utilisation as fractions."""
    names = [*CONTIGUOUS_POLICIES, "paged"]
    return {
        "block_size": block_size,
        "utilization": {
            **{name: round(results[name].utilization, 4) for name in names},
            "paged_limit": round(expected_utilization(requests, block_size), 4),
        },
        "max_concurrent": {name: results[name].max_concurrent for name in names},
        "paged_by_block_size": {str(size): round(results[f"paged_{size}"].utilization, 4) for size in BLOCK_SIZES},
    }


def _paper_columns(name: str) -> tuple[str, str]:
    """Fig. 2's token share of all KV memory, and of the memory left once external fragmentation is removed."""
    if name not in PAPER_FIG2:
        return f"{PAPER_VLLM_UTILIZATION:.3f}", "—"
    tokens, *_, external = PAPER_FIG2[name]
    return f"{tokens / 100:.3f}", f"{tokens / (100 - external):.3f}"


def table(requests: list[Request], results: dict[str, SimResult], block_size: int, num_slots: int) -> str:
    paged = results["paged"]
    first, last = paged.window
    lines = [
        describe(requests),
        (
            f"KV budget {num_slots} token slots; FCFS, all requests queued at step 0; measured over the saturated "
            f"steps after a {WARMUP_FRACTION:.0%} warm-up (paged at block {block_size}: steps {first}–{last})"
        ),
        "",
        "util: tokens stored / slots reserved (contiguous) or allocated (paged); expected: the same without",
        "external fragmentation (for paged, the limit); of pool: tokens stored / all slots; paper: Fig. 2's token",
        "share of all KV memory; w/o ext.: Fig. 2 without its 'external fragmentation & others', comparable to util;",
        "preempted / recomputed: preemptions by recompute and the tokens they prefill again.",
        "",
        (
            f"{'policy':<20}{'util':>7}{'expected':>10}{'paper':>7}{'w/o ext.':>10}{'of pool':>9}"
            f"{'mean held':>11}{'peak held':>11}{'preempted':>11}{'recomputed':>12}"
        ),
    ]
    policies: dict[str, ReservationPolicy | int] = {**CONTIGUOUS_POLICIES, "paged": block_size}
    for name, policy in policies.items():
        result = results[name]
        paper, paper_wo_ext = _paper_columns(name)
        label = f"paged (block {block_size})" if name == "paged" else name
        lines.append(
            f"{label:<20}{result.utilization:>7.3f}{expected_utilization(requests, policy):>10.3f}{paper:>7}"
            f"{paper_wo_ext:>10}{result.pool_utilization:>9.3f}{result.mean_concurrent:>11.1f}"
            f"{result.max_concurrent:>11}{result.num_preemptions:>11}{result.num_recomputed_tokens:>12}"
        )
    lines += [
        "",
        (
            f"{'paged, block size':<20}{'util':>7}{'limit':>10}{'of pool':>9}{'mean held':>11}{'peak held':>11}"
            f"{'preempted':>11}{'recomputed':>12}"
        ),
    ]
    for size in BLOCK_SIZES:
        result = results[f"paged_{size}"]
        lines.append(
            f"{size:<20}{result.utilization:>7.3f}{expected_utilization(requests, size):>10.3f}"
            f"{result.pool_utilization:>9.3f}{result.mean_concurrent:>11.1f}{result.max_concurrent:>11}"
            f"{result.num_preemptions:>11}{result.num_recomputed_tokens:>12}"
        )
    lines += ["", f"{'requests held, paged ÷':<24}{'mean':>7}{'peak':>7}{'expected':>10}{'paper (Fig. 13a)':>18}"]
    expected_paged = expected_mean_concurrent(requests, block_size, num_slots)
    for name, paper_ratio in PAPER_BATCHED_RATIO.items():
        expected = expected_paged / expected_mean_concurrent(requests, CONTIGUOUS_POLICIES[name], num_slots)
        lines.append(
            f"{name:<24}{paged.mean_concurrent / results[name].mean_concurrent:>7.2f}"
            f"{paged.max_concurrent / results[name].max_concurrent:>7.2f}{expected:>10.2f}{paper_ratio:>18.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    parser.add_argument("--num-slots", type=int, default=NUM_SLOTS, help="KV budget in token slots")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    requests = sharegpt_like_requests(args.num_requests, args.seed)
    results = run_all(requests, args.block_size, args.num_slots)
    if args.json:
        print(json.dumps(summary(requests, results, args.block_size)))
    else:
        print(table(requests, results, args.block_size, args.num_slots))


if __name__ == "__main__":
    main()
