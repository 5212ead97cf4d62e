"""Data parallelism: which replica a new sequence runs on, decided once, when it is first admitted.

A sequence placed on replica r computes there, keeps its blocks there, and finds in the prefix cache only what r's
pool holds. Placement trades load (an idle replica beside a queue wastes a model's worth of compute) against cache
(a prefix one pool holds skips its prefill there only). Four policies answer `place(seq, replicas)` from the
replicas' state (`ReplicaState`):

    round_robin    replica 0, 1, ..., N - 1, 0, ...: neither load nor cache
    least_loaded   the smallest `ReplicaState.load`, vLLM's score (running + waiting, a waiting request weighing
                   more as its pool fills past half); ties rotate, as vLLM's scan start does
    prefix         the pool holding the longest run of the prompt's leading full blocks (their hashes looked up in
                   each pool), among replicas within `load_cap` of the least loaded; ties and near-ties (within
                   `near_tie_blocks`) go to the least loaded
    approx_prefix  SGLang's cache-aware routing: an approximate tree of the prompts each replica was sent; past a
                   match threshold the best match, else (and while loads are out of balance) the least loaded

Where this lives in vLLM (read 2026-12-03, stored copy at commit 00080ee): `vllm/v1/engine/core_client.py`,
`DPLBAsyncMPClient.get_core_engine_for_request`, the load score; vLLM places a request on arrival and looks at no
cache. In SGLang: its router's `sgl-router/src/policies/cache_aware.rs` (stored copy at 026f853; `tree.rs` the
approximate radix tree of request text, of token ids here), renamed `sgl-model-gateway/src/policies/cache_aware.rs`
by PR #14312 (stored copy at b93974f). Our scheduler places at admission with every pool's hashes in hand, so
`prefix` needs no approximation.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import get_args

from solutions.config import DataParallelPlacement
from solutions.core.sequence import Sequence

PLACEMENT_POLICIES = get_args(DataParallelPlacement)


@dataclass(slots=True)
class ReplicaState:
    """What a placement policy sees of one live replica when a sequence is placed: its counts at that moment, read
    from its scheduler and its pool (exact and current, where vLLM's front end works from snapshots the engines
    publish)."""

    replica: int
    num_running: int  # sequences running there (the samples they will fork included)
    num_waiting: int  # sequences placed there and waiting (preempted ones among them)
    num_free_blocks: int  # in its pool (cached free blocks count as free)
    num_cached_blocks: int = 0  # of this sequence's prompt: leading full blocks its pool holds now
    num_blocks: int | None = None  # its pool's size; None (a state built by hand): its KV cache usage is not known

    @property
    def kv_cache_usage(self) -> float:
        """The share of its pool in use, `1 - num_free_blocks / num_blocks`, as vLLM's `BlockPool.get_usage`; 0.0 (no KV
        pressure) for a state built without its pool's size."""
        return 0.0 if self.num_blocks is None else 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def load(self) -> float:
        """vLLM's load score of a data-parallel engine: `running + waiting + waiting * 6 * max(0, usage - 0.5)`.

        A queue on an engine whose KV cache is more than half full drains slowly, so each waiting request weighs from 1
        (at 50% usage or less) up to 4 (a full pool). vLLM (`DPLBAsyncMPClient.get_core_engine_for_request`, read
        2026-12-03 at commit 00080ee, since PR #49204; before it `waiting * 4 + running`) also takes the max with
        `client_count * inflight`, a floor against its engines' stale ~100 ms snapshots; here the scheduler reads each
        replica's queues when it places, so that floor never exceeds the counts and is left out.
        """
        pressure = max(0.0, self.kv_cache_usage - 0.5)
        return self.num_running + self.num_waiting + self.num_waiting * 6 * pressure


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
    """The smallest load score; ties to the first met in a scan that starts one replica further at every placement,
    as vLLM's `eng_start_index` does (PR #47420), so equal scores are spread in turn."""

    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.start = 0  # where the next scan begins: a replica index

    def place(self, seq: Sequence, replicas: list[ReplicaState]) -> int:
        order = sorted(replicas, key=lambda state: (state.replica - self.start) % self.num_replicas)
        self.start = (self.start + 1) % self.num_replicas
        return min(order, key=lambda state: state.load).replica  # min keeps the first of equal keys


class PrefixAwarePolicy(PlacementPolicy):
    """The longest cached prefix, exactly, under a load cap; ties and near-ties by load (`place_by_prefix`): a block
    or two of prefill is cheaper than a queue. With nothing cached anywhere this is `least_loaded`."""

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
    matched leaves are dropped (SGLang's router evicts its trees by LRU too)."""

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
    """SGLang's cache-aware policy over token trees. Out of balance (the loads differ by more than
    `balance_abs_threshold` and the largest exceeds `balance_rel_threshold` times the smallest): the least loaded.
    Otherwise the replica whose tree matches the most of the prompt if that is more than `cache_threshold` of it,
    else the least loaded. The prompt then joins the chosen replica's tree. A replica's load here is its running
    and waiting sequences (SGLang's router reads `Worker::load()`).

    Below the threshold, `sgl-model-gateway/src/policies/cache_aware.rs` (stored copy at b93974f) picks the least
    loaded healthy worker since PR #14650 (the older `sgl-router` picked the smallest tree). The defaults are those
    `sgl-model-gateway/bindings/python/sglang_router/router_args.py` gives a user (stored copy at 0c02081)."""

    def __init__(
        self, num_replicas: int, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5, max_tree_tokens: int = 1 << 20,
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
    policies = {"round_robin": RoundRobinPolicy, "least_loaded": lambda: LeastLoadedPolicy(num_replicas),
                "prefix": PrefixAwarePolicy, "approx_prefix": lambda: ApproxPrefixPolicy(num_replicas)}
    if name not in policies:
        raise ValueError(f"data_parallel_placement must be one of {PLACEMENT_POLICIES}, got {name!r}")
    return policies[name]()
