"""Data parallelism: which replica a new sequence runs on, decided once, when it is first admitted.

Every replica holds the whole model and a KV block pool of its own, so a sequence placed on replica r computes
there, keeps its blocks there, and finds in the prefix cache only what r's pool holds. Placement trades two things:
load (an idle replica next to a queue wastes a whole model's worth of compute) and cache (a prompt whose prefix one
pool holds skips that prefill there, and nowhere else). Four policies answer the same question, `place(seq,
replicas)`, from the replicas' state at that moment (`ReplicaState`):

    round_robin    replica 0, 1, ..., N - 1, 0, ...: neither load nor cache
    least_loaded   the smallest `waiting * 4 + running` (vLLM's score for its data-parallel engines)
    prefix         the pool holding the longest run of the prompt's leading full blocks (exact: their hashes are
                   looked up in each pool), among replicas whose load is within `load_cap` of the least loaded, so
                   one hot prefix cannot pile every request onto one replica; ties and near-ties (within
                   `near_tie_blocks` blocks of the best) go to the least loaded
    approx_prefix  SGLang's cache-aware router: an approximate tree of the prompts each replica was sent (never told
                   what the pool evicted); past a match threshold, the best match, else the shortest queue; and the
                   shortest queue whatever the match while the loads are out of balance

Where this lives in vLLM: `vllm/v1/engine/core_client.py` (`DPLBAsyncMPClient`, the load score; vLLM places a
request when it arrives, on one of N engine cores, each with its own scheduler and KV cache, and looks at no cache).
SGLang: `sgl-router`'s cache-aware policy (`src/policies/cache_aware.rs`, its `tree.rs` the approximate radix tree
of request text; we store token ids, so "characters" are tokens here). Our scheduler places at admission, with every
pool's hashes in hand, so the `prefix` policy needs no approximation.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import get_args

from solutions.config import DataParallelPlacement
from solutions.core.sequence import Sequence

PLACEMENT_POLICIES = get_args(DataParallelPlacement)


@dataclass(slots=True)
class ReplicaState:
    """What a placement policy sees of one live replica when a sequence is placed."""

    replica: int
    num_running: int  # sequences running there (the samples they will fork included)
    num_waiting: int  # sequences placed there and waiting (preempted ones among them)
    num_free_blocks: int  # in its pool (cached free blocks count as free)
    num_cached_blocks: int = 0  # of this sequence's prompt: leading full blocks its pool holds now

    @property
    def load(self) -> int:
        """vLLM's load score of a data-parallel engine: a waiting request weighs four running ones."""
        return self.num_waiting * 4 + self.num_running


class PlacementPolicy(ABC):
    """Chooses the replica of a sequence; `replicas` are the live ones that can take it now (never empty)."""

    @abstractmethod
    def place(self, seq: Sequence, replicas: list[ReplicaState]) -> int:
        """The chosen replica's index (`ReplicaState.replica`)."""


class RoundRobinPolicy(PlacementPolicy):
    """Each replica in turn, skipping those that cannot take the sequence now."""

    def __init__(self) -> None:
        self.next_replica = 0

    def place(self, seq: Sequence, replicas: list[ReplicaState]) -> int:
        ids = sorted(state.replica for state in replicas)
        chosen = next((r for r in ids if r >= self.next_replica), ids[0])
        self.next_replica = chosen + 1
        return chosen


class LeastLoadedPolicy(PlacementPolicy):
    """The smallest load score; ties to the lowest index."""

    def place(self, seq: Sequence, replicas: list[ReplicaState]) -> int:
        return min(replicas, key=lambda state: (state.load, state.replica)).replica


class PrefixAwarePolicy(PlacementPolicy):
    """The longest cached prefix, exactly, under a load cap; ties and near-ties by load.

    A replica is a candidate if its load is at most the smallest load + `load_cap`; among candidates, those within
    `near_tie_blocks` cached blocks of the best count as equally good (a block or two of prefill is cheaper than a
    queue), and the least loaded of them wins. With nothing cached anywhere this is `least_loaded`.
    """

    def __init__(self, load_cap: int = 4, near_tie_blocks: int = 1) -> None:
        if load_cap < 0 or near_tie_blocks < 0:
            raise ValueError(f"load_cap and near_tie_blocks must be >= 0, got {load_cap} and {near_tie_blocks}")
        self.load_cap, self.near_tie_blocks = load_cap, near_tie_blocks

    def place(self, seq: Sequence, replicas: list[ReplicaState]) -> int:
        """`place_by_prefix`, looked up in this module when called (chapter 12's decision)."""
        return place_by_prefix(replicas, self.load_cap, self.near_tie_blocks)


def place_by_prefix(replicas: list[ReplicaState], load_cap: int, near_tie_blocks: int) -> int:
    """The `prefix` policy's choice among `replicas` (live, each able to take the sequence now): the index
    (`ReplicaState.replica`) of the least loaded among those that hold within `near_tie_blocks` blocks of the longest
    cached prefix, considering only replicas whose load is at most the smallest load + `load_cap`."""
    min_load = min(state.load for state in replicas)
    candidates = [state for state in replicas if state.load <= min_load + load_cap]
    best = max(state.num_cached_blocks for state in candidates)
    good = [state for state in candidates if state.num_cached_blocks >= best - near_tie_blocks]
    return min(good, key=lambda state: (state.load, -state.num_cached_blocks, state.replica)).replica


class TokenTree:
    """SGLang's approximate radix tree of one worker, as a trie of token ids: every prompt routed there is inserted;
    nothing is ever learnt about what the pool really keeps. Bounded: past `max_tokens` nodes, the least recently
    matched leaves are dropped (sgl-router evicts its trees by LRU too)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.root: dict[int, list] = {}  # token -> [children, last use]
        self.num_tokens = 0
        self.clock = 0

    def match(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` are in the tree."""
        children, matched = self.root, 0
        for token_id in token_ids:
            if token_id not in children:
                break
            children, matched = children[token_id][0], matched + 1
        return matched

    def insert(self, token_ids: list[int]) -> None:
        self.clock += 1
        children = self.root
        for token_id in token_ids:
            if token_id not in children:
                children[token_id] = [{}, self.clock]
                self.num_tokens += 1
            node = children[token_id]
            node[1] = self.clock
            children = node[0]
        while self.num_tokens > self.max_tokens:
            self._drop_oldest_leaf()

    def _drop_oldest_leaf(self) -> None:
        """Walk to the least recently used leaf (the oldest child at each level) and cut it."""
        parent = self.root
        while True:
            key = min(parent, key=lambda k: parent[k][1])
            if not parent[key][0]:
                break
            parent = parent[key][0]
        del parent[key]
        self.num_tokens -= 1


class ApproxPrefixPolicy(PlacementPolicy):
    """sgl-router's cache-aware policy over token trees. Out of balance (the loads differ by more than
    `balance_abs_threshold` and the largest exceeds `balance_rel_threshold` times the smallest): the shortest queue.
    Otherwise the replica whose tree matches the most of the prompt if that is more than `cache_threshold` of it,
    else the shortest queue. The prompt then joins the chosen replica's tree. (sgl-router's defaults: 0.5, 32 and
    1.0001; below the threshold it picks the smallest tree, where the issue and this course take the shortest
    queue.)"""

    def __init__(
        self, num_replicas: int, cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001, max_tree_tokens: int = 1 << 20,
    ) -> None:
        self.trees = [TokenTree(max_tree_tokens) for _ in range(num_replicas)]
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold, self.balance_rel_threshold = balance_abs_threshold, balance_rel_threshold

    def place(self, seq: Sequence, replicas: list[ReplicaState]) -> int:
        loads = {state.replica: state.num_running + state.num_waiting for state in replicas}
        shortest = min(loads, key=lambda r: (loads[r], r))
        low, high = min(loads.values()), max(loads.values())
        imbalanced = high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold
        chosen = shortest
        if not imbalanced:
            prompt = seq.prompt_token_ids
            matched = {r: self.trees[r].match(prompt) for r in loads}
            best = max(loads, key=lambda r: (matched[r], -loads[r], -r))
            if matched[best] / len(prompt) > self.cache_threshold:
                chosen = best
        self.trees[chosen].insert(seq.prompt_token_ids)
        return chosen


def create_placement_policy(name: str, num_replicas: int) -> PlacementPolicy:
    """The policy `data_parallel_placement` names (validated by `EngineArgs`)."""
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "prefix":
        return PrefixAwarePolicy()
    if name == "approx_prefix":
        return ApproxPrefixPolicy(num_replicas)
    raise ValueError(f"data_parallel_placement must be one of {PLACEMENT_POLICIES}, got {name!r}")
