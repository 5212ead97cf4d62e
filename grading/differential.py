"""Differential grading: an exercise against the reference on engine states that no test wrote by hand.

A chapter's example tests build the states its questions are about, and catch the mistakes someone thought of. These
run the exercise where the engine runs it, on generated workloads: a workload is stepped with the reference, and
before each step the world is copied twice; one copy steps with the reference, the other with the exercise swapped
in (`swap_in`, as the capstone), and everything reachable from the two copies afterwards is compared — queues and
their order, block tables, pools and the order of their free queues (the LRU order), reference counts, counters,
the step's output. Hypothesis draws the workloads (seeded: the same examples on every run, few and small); a failing
workload is cut down, within a few seconds, to the fewest requests that still fail, and the failure names that
workload, the step and the first values that differ.
"""

import copy
import enum
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from grading.capstone import swap_in
from solutions.core.sched.output import ModelRunnerOutput, sampling_rows
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


def step_alike(impl: Any, exercise: str, reference: Callable, world: Any, step: Callable[[Any], Any],
               inputs: str) -> Any:
    """Run `step` on `world` with the reference and on a copy with `impl`'s `exercise` swapped in; fail, naming
    `inputs` and the first differences, unless the two worlds and the step's results are alike. Returns `world`,
    stepped: the world of the next step."""
    expected_world, got_world = world, copy.deepcopy(world)
    expected_result = step(expected_world)
    try:
        with swap_in(impl, {exercise: reference}):
            got_result = step(got_world)
    except Exception as error:  # not an AssertionError: a stub's, or a wrong answer that breaks the engine's step
        raise AssertionError(f"exercise `{exercise}`, run by the engine on a generated workload, made the step raise "
                             f"{type(error).__name__}: {error}\n  {inputs}") from error
    diff = differences(snapshot((expected_world, expected_result)), snapshot((got_world, got_result)))
    if diff:
        raise AssertionError(f"exercise `{exercise}`, run by the engine on a generated workload, leaves another state "
                             f"than the reference's.\n  {inputs}\n  first differences (state[0] is the world after "
                             "the step, state[1] what the step returned):\n    " + "\n    ".join(diff))
    return expected_world


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
    return 300 + (7 * seq.seq_id + 13 * seq.num_tokens) % 97


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


def run_alike(impl: Any, exercise: str, reference: Callable, make_world: Callable[[list[RequestSpec]], Any],
              specs: list[RequestSpec], step: Callable[[Any], Any], inputs: str, max_steps: int = 32,
              shrink_seconds: float = 8.0) -> None:
    """`step_alike` at every step of the workload `specs` (on `make_world(specs)`), until it is done or `max_steps`.
    If it fails, the workload is cut down first: requests are dropped one at a time while it still fails (for at most
    `shrink_seconds`), and the failure of the smallest is raised."""

    def failure(candidate: list[RequestSpec]) -> AssertionError | None:
        world = make_world(candidate)
        try:
            while not world.done and world.step < max_steps:
                world = step_alike(impl, exercise, reference, world, step,
                                   f"{inputs}; requests {candidate}; before step {world.step}")
        except AssertionError as error:
            return error
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
