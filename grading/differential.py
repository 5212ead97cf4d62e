"""Differential grading: an exercise against the reference on engine states that no test wrote by hand.

A chapter's example tests build the states its questions are about, and catch the mistakes someone thought of. These
run the exercise where the engine runs it, on generated workloads: two worlds are built from the same workload, one
with the reference and one with the exercise swapped in (`swap_in`, as the capstone: a class exercise is the class
the world is built with), and stepped side by side; after every step, everything reachable from the two is compared
— queues and their order, block tables, pools and the order of their free queues (the LRU order), reference counts,
counters, the step's output. Hypothesis draws the workloads (seeded: the same examples on every run, few and small); a
failing workload is cut down, within a few seconds, to the fewest requests that still fail, and the failure names
that workload, the step and the first values that differ.
"""

import enum
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from grading.capstone import swap_in
from solutions.core.sched.output import DraftTokenIds, ModelRunnerOutput, sampling_rows
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.sampling_params import SamplingParams

# Few, small examples: a chapter's notebook runs its tests in under a minute. Hypothesis's own shrinking is off (it
# has no time bound short of minutes); `run_alike` cuts a failing workload down itself, in bounded time.
DIFFERENTIAL_SETTINGS = settings(
    max_examples=8, deadline=None, derandomize=True, database=None, print_blob=False,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)

_LEAVES = (type(None), bool, int, float, str, bytes)
_SKIPPED = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType, type)


Node = tuple[Any, str] | None  # (parent node, key): a value's path, rendered only where it is reported


def snapshot(root: Any) -> list[tuple[Node, Any]]:
    """Every value reachable from `root`, in a fixed order, as (path, leaf). An object met again is recorded as the
    index of the entry where it was first met, so shared blocks and sequences compare as shared. A container with
    its own iteration order (a request queue) is recorded in that order, not by its internal layout (a heap's)."""
    entries: list[tuple[Node, Any]] = []
    seen: dict[int, int] = {}
    stack: list[tuple[Node, Any]] = [(None, root)]
    while stack:
        node, value = stack.pop()
        if isinstance(value, _LEAVES):
            entries.append((node, value))
        elif isinstance(value, enum.Enum):
            entries.append((node, f"{type(value).__name__}.{value.name}"))
        elif isinstance(value, _SKIPPED) or type(value).__module__.startswith("torch"):
            continue
        elif id(value) in seen:
            entries.append((node, ("same object as entry", seen[id(value)])))
        else:
            seen[id(value)] = len(entries)
            children = list(_children(value))
            entries.append((node, (type(value).__name__, len(children))))
            stack.extend(((node, key), child) for key, child in reversed(children))
    return entries


def _children(value: Any) -> Iterable[tuple[str, Any]]:
    if isinstance(value, dict):
        return ((f"[{k!r}]" if isinstance(k, _LEAVES) else f"[key {i}]", v) for i, (k, v) in enumerate(value.items()))
    if isinstance(value, (set, frozenset)):
        return ((f"{{{i}}}", v) for i, v in enumerate(sorted(value, key=repr)))
    if isinstance(value, (list, tuple)) or hasattr(type(value), "__iter__"):
        return ((f"[{i}]", v) for i, v in enumerate(value))
    names = list(getattr(value, "__dict__", {}))
    names += [s for cls in type(value).__mro__ for s in getattr(cls, "__slots__", ()) if s not in names]
    return ((f".{n}", getattr(value, n)) for n in names if hasattr(value, n))


def _path(node: Node) -> str:
    keys = []
    while node is not None:
        node, key = node
        keys.append(key)
    return "state" + "".join(reversed(keys))


def differences(expected: list[tuple[Node, Any]], got: list[tuple[Node, Any]], limit: int = 6) -> list[str]:
    """The first `limit` places where two snapshots differ, as "path: expected ..., got ..."."""
    def shown(entries: list[tuple[Node, Any]], value: Any) -> Any:
        if isinstance(value, tuple) and value[:1] == ("same object as entry",):
            return f"the object at {_path(entries[value[1]][0])}"
        return value

    found = []
    for (node, want), (other, have) in zip(expected, got):
        if (node and node[1]) != (other and other[1]) or want != have:
            path = _path(node)
            if found and path != _path(other):
                break  # past the first difference the two walks part: what follows would be noise
            found.append(f"{path}: expected {shown(expected, want)!r}, got {shown(got, have)!r}")
            if len(found) == limit:
                break
    if len(expected) != len(got) and len(found) < limit:
        found.append(f"{len(expected)} values expected in all, {len(got)} found")
    return found


# --- scheduler workloads: requests that arrive, fork, finish and are aborted, stepped without a model ---------------


@dataclass(frozen=True)
class RequestSpec:
    """A generated request: a shared prefix (or none), its own tokens after it, its samples and length, its
    priority, the step it arrives before and the step it is aborted before (None: never)."""

    prefix: int | None
    tail: int
    n: int
    max_tokens: int
    priority: int
    arrives: int
    aborted: int | None

    def prompt(self, index: int) -> list[int]:
        shared = [] if self.prefix is None else [1000 + 100 * self.prefix + i for i in range(PREFIX_TOKENS)]
        return shared + [2000 + 37 * index + i for i in range(self.tail)]


PREFIX_TOKENS = 8


def request_specs(min_requests: int = 4, max_requests: int = 8, max_n: int = 3, max_priority: int = 2,
                  last_arrival: int = 10) -> st.SearchStrategy:
    """Lists of `RequestSpec`s: prompts of 1 to 19 tokens (most behind one of two shared prefixes), 1 to `max_n`
    samples of 2 to 12 tokens, arrivals up to step `last_arrival`, a few aborted: enough for a small pool to preempt,
    and for a prefix to come back after it was evicted."""
    spec = st.builds(
        RequestSpec, prefix=st.sampled_from([0, 1, 0, 1, None]), tail=st.integers(1, 11), n=st.integers(1, max_n),
        max_tokens=st.integers(2, 12), priority=st.integers(0, max_priority), arrives=st.integers(0, last_arrival),
        aborted=st.one_of(st.none(), st.none(), st.integers(1, 16)),
    )
    return st.lists(spec, min_size=min_requests, max_size=max_requests)


@dataclass
class SchedulerWorld:
    """A scheduler and the workload that feeds it; `step` counts the steps run."""

    scheduler: Any
    requests: list[RequestSpec]
    step: int = 0
    next_seq_id: int = 0

    def arrive(self) -> None:
        """Add the requests due before this step (as the engine core does: samples forked once the prompt is in);
        abort those whose time has come."""
        for index, spec in enumerate(self.requests):
            if spec.arrives == self.step:
                seq = Sequence(self.next_seq_id, spec.prompt(index), priority=spec.priority, arrival=index)
                seq.request_id = f"r{index}"
                seq.sampling_params = SamplingParams(n=spec.n, max_tokens=spec.max_tokens, ignore_eos=True)
                seq.fork_seq_ids = list(range(self.next_seq_id + 1, self.next_seq_id + spec.n))
                self.next_seq_id += spec.n
                self.scheduler.add_request(seq)
        aborted = [f"r{i}" for i, spec in enumerate(self.requests) if spec.aborted == self.step]
        self.scheduler.finish_requests(aborted, SequenceStatus.FINISHED_ABORTED)

    @property
    def done(self) -> bool:
        return self.step > max(spec.arrives for spec in self.requests) and not self.scheduler.has_unfinished_requests()


def sampled_token(seq: Sequence) -> int:
    """The token a step samples for `seq`: a function of the sample and its length, so forked samples diverge."""
    return _token_at(seq, seq.num_tokens)


def scheduler_step(world: SchedulerWorld) -> Any:
    """One engine step without a model: arrivals and aborts, `schedule()`, a token for every sampling row, then
    `update_from_output`. Returns the step's `SchedulerOutput`."""
    world.arrive()
    out = world.scheduler.schedule()
    _, seqs = sampling_rows(out)
    world.scheduler.update_from_output(
        out, ModelRunnerOutput([s.seq_id for s in seqs], [[sampled_token(s)] for s in seqs], [None] * len(seqs))
    )
    world.step += 1
    return out


def run_alike(impl: Any, exercise: str, reference: Any, make_world: Callable[[list[RequestSpec]], Any],
              specs: list[RequestSpec], step: Callable[[Any], Any], inputs: str, max_steps: int = 32,
              shrink_seconds: float = 8.0) -> None:
    """Step a world of the workload `specs` built with the reference and one built and stepped with `impl`'s
    `exercise` swapped in, side by side, until the workload is done (or `max_steps`); fail, naming the workload, the
    step and the first differences, unless the two and each step's results stay alike. A failing workload is cut down
    first: requests are dropped one at a time while it still fails (for at most `shrink_seconds`)."""

    def failure(candidate: list[RequestSpec]) -> AssertionError | None:
        expected, where = make_world(candidate), f"{inputs}; requests {candidate}"
        try:
            with swap_in(impl, {exercise: reference}):
                got = make_world(candidate)
            while not expected.done and expected.step < max_steps:
                where = f"{inputs}; requests {candidate}; step {expected.step}"
                expected_result = step(expected)
                with swap_in(impl, {exercise: reference}):
                    got_result = step(got)
                diff = differences(snapshot((expected, expected_result)), snapshot((got, got_result)))
                if diff:
                    return AssertionError(
                        f"exercise `{exercise}`, run by the engine on a generated workload, leaves another state than "
                        f"the reference's.\n  {where}\n  first differences (state[0] is the world after the step, "
                        "state[1] what the step returned):\n    " + "\n    ".join(diff))
        except AssertionError as error:  # a stub's ExerciseError, or an assertion inside the engine
            return AssertionError(f"{error}\n  (exercise `{exercise}`, {where})")
        except Exception as error:  # a wrong answer that breaks the engine's step
            return AssertionError(f"exercise `{exercise}`, run by the engine on a generated workload, made the step "
                                  f"raise {type(error).__name__}: {error}\n  {where}")
        return None

    error = failure(specs)
    if error is None:
        return
    deadline = time.monotonic() + shrink_seconds
    index = 0
    while index < len(specs) and len(specs) > 1 and time.monotonic() < deadline:
        smaller = specs[:index] + specs[index + 1 :]
        if (smaller_error := failure(smaller)) is not None:
            specs, error = smaller, smaller_error
        else:
            index += 1
    raise error


@st.composite
def scheduler_workloads(draw) -> tuple[Callable[[list[RequestSpec]], SchedulerWorld], list[RequestSpec], str]:
    """Chapter 5's `Scheduler` over a `KVCacheManager` of 8 to 16 blocks of 4 tokens (prefix caching on or off) and
    a generated workload: admissions, chunked prefills, forks, prefix hits, preemptions and aborts happen on their own.
    The world is built from the modules' names when it is made, so a class exercise swapped in is the one built.
    Returns (the world of a workload, the workload, the setting in words)."""
    from solutions.core import kv_cache_manager
    from solutions.core.sched import scheduler
    from solutions.core.sched.request_queue import SchedulingPolicy

    num_blocks, caching = draw(st.integers(8, 16)), draw(st.booleans())
    policy, max_num_seqs, budget = draw(st.sampled_from(SchedulingPolicy)), draw(st.integers(2, 8)), draw(
        st.integers(2, 24))

    def make_world(specs: list[RequestSpec]) -> SchedulerWorld:
        manager = kv_cache_manager.KVCacheManager(num_blocks, 4, enable_prefix_caching=caching)
        return SchedulerWorld(scheduler.Scheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                                  long_prefill_token_threshold=budget, policy=policy,
                                                  max_model_len=64), specs)

    inputs = (f"block_size 4, {num_blocks} blocks, prefix caching {caching}, policy {policy.name}, max_num_seqs "
              f"{max_num_seqs}, budget {budget}")
    return make_world, draw(request_specs(last_arrival=6)), inputs


def drafting_step(world: SchedulerWorld) -> Any:
    """`scheduler_step` with speculative decoding: each sampling row's drafts are verified against the tokens the
    step samples (`sampled_token` at each position; accepted up to the first mismatch, then one more), and after the
    step each running sampler is given 1 to 4 new drafts, some right, then a wrong one. Returns the
    `SchedulerOutput`."""
    world.arrive()
    out = world.scheduler.schedule()
    _, seqs = sampling_rows(out)
    sampled = []
    for seq in seqs:
        tokens: list[int] = []
        for draft in out.scheduled_spec_decode_tokens.get(seq.seq_id, []):
            if draft != _token_at(seq, seq.num_tokens + len(tokens)):
                break
            tokens.append(draft)
        sampled.append(tokens + [_token_at(seq, seq.num_tokens + len(tokens))])
    world.scheduler.update_from_output(out, ModelRunnerOutput([s.seq_id for s in seqs], sampled, [None] * len(seqs)))
    proposing = [seq for seq in seqs if seq.status is SequenceStatus.RUNNING]
    drafts = []
    for seq in proposing:
        num_drafts = 1 + (seq.seq_id + seq.num_tokens) % 4
        num_right = (5 * seq.seq_id + seq.num_tokens) % (num_drafts + 1)
        drafts.append([_token_at(seq, seq.num_tokens + j) if j < num_right else 999 for j in range(num_drafts)])
    world.scheduler.update_draft_token_ids(DraftTokenIds([seq.seq_id for seq in proposing], drafts))
    world.step += 1
    return out


def _token_at(seq: Sequence, position: int) -> int:
    """The token sampled at `position` of `seq` (as `sampled_token`, which samples at `seq.num_tokens`)."""
    return 300 + (7 * seq.seq_id + 13 * position) % 97


def differential_test(reference: dict[str, Any], exercises: tuple[str, ...],
                      workloads: Callable[[str], st.SearchStrategy], step: Callable[[Any], Any] = scheduler_step,
                      note: str = "") -> Callable:
    """A chapter's differential test, one case per exercise in `exercises`: `workloads(exercise)` draws (the world of
    a workload, the workload, the setting in words), and `run_alike` steps it with `step`. Assign it to a `test_` name
    in the chapter's test file."""

    @pytest.mark.parametrize("exercise", [pytest.param(name, marks=pytest.mark.exercise(name)) for name in exercises])
    @DIFFERENTIAL_SETTINGS
    @given(data=st.data())
    def test(exercise: str, impl: Any, data: st.DataObject) -> None:
        make_world, specs, inputs = data.draw(workloads(exercise), label="workload")
        run_alike(impl, exercise, reference[exercise], make_world, specs, step, inputs + note)

    return test
