"""The site's picture of the engine's spine (docs/spine.md) is the one a live engine draws today, and the engine's
layers point down only."""

import ast
import pickle
from pathlib import Path

import pytest
import torch

from grading.spine import PAGE, build
from solutions import SamplingParams
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sched.output import ModelRunnerOutput, sampling_rows
from solutions.core.sched.scheduler import Scheduler
from solutions.core.sequence import Sequence
from solutions.engine.core_client import MPClient
from solutions.utils.math_utils import cdiv
from solutions.worker.cached_requests import CachedRequests, StepEncoder

SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions"
# Each layer may import itself and the layers below it, never one above (the front ends and entry points on top).
LAYERS = ["entrypoints", "engine", "executor", "worker", "structured_output", "core", "model", "attention"]
# The engine's messages (`solutions/engine/__init__.py`: requests down, replies up) belong to both sides, as vLLM's
# `vllm/v1/engine/__init__.py` does: the front ends send the requests, the scheduler fills the replies.
MESSAGES = "solutions.engine"
# The front ends reach the engine core through those messages and a client, never through its parts.
FRONT_ENDS = [*sorted((SOLUTIONS / "entrypoints").rglob("*.py")), *(
    path for path in sorted((SOLUTIONS / "engine").glob("*.py")) if path.name != "core.py"
)]
# The config is read by every layer, so it imports none of the layers that read it (the runner above all).
CONFIGS = [SOLUTIONS / "config.py", SOLUTIONS / "engine" / "arg_utils.py"]
REPOSITORY = SOLUTIONS.parent
# The folders whose code and notebooks reach the engine core: through its client, all of them.
CALLERS = ["solutions", "grading", "tests", "benchmarks", "chapters", "kernels", "docs"]


def test_the_stored_spine_is_the_one_the_engine_draws_now():
    assert PAGE.read_text() == build(), "docs/spine.md is stale: run `python -m grading.spine`"


def imported_modules(path: Path) -> set[str]:
    """The `solutions.` modules `path` imports when it runs (imports for type checkers only are left out)."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(child) for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for child in ast.walk(node)
    }
    nodes = [node for node in ast.walk(tree) if id(node) not in type_only]
    names = {alias.name for node in nodes if isinstance(node, ast.Import) for alias in node.names}
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)  # and a module named from its package (`from solutions.engine import core`):
            package = SOLUTIONS.parent / node.module.replace(".", "/")
            names |= {f"{node.module}.{alias.name}" for alias in node.names
                      if (package / f"{alias.name}.py").exists() or (package / alias.name).is_dir()}
    return {name for name in names if name.startswith("solutions.")}


def imports_of(paths: list[Path], packages: tuple[str, ...]) -> list[str]:
    """'<file> imports <module>' for each module of `packages` that one of `paths` imports."""
    return [
        f"{path.relative_to(SOLUTIONS.parent)} imports {module}"
        for path in paths for module in sorted(imported_modules(path))
        if any(module == package or module.startswith(package + ".") for package in packages)
    ]


def test_layers_point_down_only():
    upward = []
    for index, layer in enumerate(LAYERS):
        above = LAYERS[:index]
        for path in sorted((SOLUTIONS / layer).rglob("*.py")):
            for module in imported_modules(path):
                parts = module.split(".")
                if module == MESSAGES:
                    continue
                if len(parts) > 1 and parts[1] in above or module == "solutions":
                    upward.append(f"{path.relative_to(SOLUTIONS.parent)} imports {module}")
    assert not upward, "lower layers import higher ones:\n" + "\n".join(upward)


def test_front_ends_import_nothing_of_the_core():
    """`LLMEngine`, `AsyncLLM`, the server and their processors hold a client and the messages, no scheduler, no
    KV cache manager, no request queue (vLLM's front ends, `vllm/v1/engine/llm_engine.py`, `async_llm.py`)."""
    found = imports_of(FRONT_ENDS, ("solutions.core",))
    assert not found, "front ends import the engine core's parts:\n" + "\n".join(found)


def test_the_config_imports_no_layer_that_reads_it():
    """`VllmConfig` and `EngineArgs` are built before any runner, scheduler or executor exists, and pickled to
    the workers: what they check (the attention backends, the policies) is named below them."""
    found = imports_of(CONFIGS, ("solutions.worker", "solutions.executor", "solutions.core"))
    assert not found, "the config imports a layer that reads it:\n" + "\n".join(found)


def test_nothing_reaches_past_the_client():
    """The front end, tests, the grader, benchmarks and chapters read the core's parts through its client
    (`scheduler`, `model_executor`, `structured_output_manager`, `has_unfinished_requests()`, `beam_search()`),
    which says so when the core runs in another process, never through the in-process core the client holds."""
    reach = ".".join(["engine_core"] * 2)  # built, so that this file does not match itself
    paths = [
        path for folder in CALLERS for path in sorted((REPOSITORY / folder).rglob("*"))
        if path.suffix in (".py", ".ipynb")
        and not any(part.startswith(".") for part in path.relative_to(REPOSITORY).parts)
    ]
    found = [
        f"{path.relative_to(REPOSITORY)}:{number}"
        for path in paths for number, line in enumerate(path.read_text().splitlines(), start=1) if reach in line
    ]
    assert not found, f"read the core's parts through the client, not `{reach}`:\n" + "\n".join(found)


def test_a_client_whose_core_is_in_another_process_names_the_alternative():
    client = MPClient.__new__(MPClient)  # no process started: the parts are refused before any is looked for
    for read in (lambda: client.scheduler, lambda: client.model_executor, lambda: client.structured_output_manager,
                 client.has_unfinished_requests):
        with pytest.raises(RuntimeError, match=r"MPClient\..*another process.*engine_core=\"thread\""):
            read()


def decode_steps_through_a_worker_pipe(
    context_len: int, num_seqs: int = 64, steps: int = 3, generators: bool = False
) -> list[int]:
    """`num_seqs` sequences of `context_len` prompt tokens through a real scheduler (no model: each sampling row
    gets token 7): the bytes of each step's message to a worker, the first step prefilling all of them. Each
    message is read back as a worker reads it, and the worker's copies must equal the engine's sequences. With
    `generators`, the sequences draw (temperature 1, each its own generator) and the worker is one that samples."""
    block_size = 16
    blocks = num_seqs * (cdiv(context_len + steps, block_size) + 1)
    scheduler = Scheduler(KVCacheManager(blocks, block_size), max_num_seqs=num_seqs,
                          max_num_batched_tokens=num_seqs * context_len, long_prefill_token_threshold=context_len,
                          max_model_len=context_len + steps + 1)
    for i in range(num_seqs):
        seq = Sequence(i, [(7 * i + j) % 250 + 3 for j in range(context_len)])
        seq.request_id = f"r{i}"
        seq.sampling_params = SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=float(generators))
        seq.generator = torch.Generator().manual_seed(i)
        scheduler.add_request(seq)
    encoder, worker = StepEncoder(block_size), CachedRequests()
    sizes = []
    for _ in range(steps):
        out = scheduler.schedule()
        message = encoder.message(out, generators)
        sizes.append(len(message))
        got = worker.apply(pickle.loads(message))
        assert [(s.seq_id, s.token_ids, s.block_table, s.num_computed_tokens) for s in got.scheduled_seqs] == [
            (s.seq_id, s.token_ids, s.block_table, s.num_computed_tokens) for s in out.scheduled_seqs
        ], "the worker's copies are the engine's sequences"
        _, seqs = sampling_rows(out)
        scheduler.update_from_output(out, ModelRunnerOutput([s.seq_id for s in seqs], [[7]] * len(seqs),
                                                            [None] * len(seqs)))
    return sizes


@pytest.mark.parametrize("generators", [False, True], ids=["greedy", "drawing"])
def test_a_decode_step_sends_a_worker_its_changes_not_its_contexts(generators):
    """vLLM's `NewRequestData` once, then `CachedRequestData` (`vllm/v1/core/sched/output.py`): a decode step's
    message grows with the new tokens (one per sequence), not with the contexts; a worker that samples is sent each
    drawing sequence's generator once, with its first data, and keeps it."""
    short = decode_steps_through_a_worker_pipe(250, generators=generators)
    long = decode_steps_through_a_worker_pipe(1000, generators=generators)
    assert long[0] - short[0] >= 64 * 750 * 2, "the first step carries every prompt whole (750 more tokens each)"
    for step in (1, 2):
        assert long[step] <= 1.05 * short[step], f"step {step}: {short[step]} B at 250 tokens, {long[step]} B at 1000"
        assert long[step] * 10 <= long[0], f"decode step {step}: {long[step]} B, the prefill's {long[0]} B"
        assert long[step] <= 64 * 150, f"decode step {step}: {long[step] / 64:.0f} B per sequence"


def functions_in(paths: list[Path]) -> dict[str, ast.FunctionDef]:
    """'<file>:<function>' -> its AST, for every function and method defined in `paths`."""
    return {
        f"{path.relative_to(SOLUTIONS.parent)}:{node.name}": node
        for path in paths for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef)
    }


def reads_running_order(function: ast.FunctionDef) -> bool:
    """Does `function` pick a sequence out of a `running` list by a fixed place or by a key (`running[-1]`,
    `max(...running...)`, `min(...running...)`)? That is a victim rule (walking it, `running[index]`, is not)."""
    for node in ast.walk(function):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "running"
                and isinstance(node.slice, ast.Constant | ast.UnaryOp)):
            return True
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("max", "min")
                and any(isinstance(arg, ast.Attribute) and arg.attr == "running" for arg in node.args)):
            return True
    return False


def test_one_victim_rule_for_both_ways_of_preempting():
    """Recompute (`allocate_or_preempt`) and swap (`select_preemption`, and the loop around it) take their victim
    from `select_victim`: no other function of the scheduler picks a running sequence by its place or its key."""
    functions = functions_in(sorted((SOLUTIONS / "core" / "sched").glob("*.py")))
    rules = sorted(name for name, function in functions.items() if reads_running_order(function))
    assert rules == ["solutions/core/sched/scheduler.py:select_victim"], f"victim rules written here: {rules}"
    for name in ("scheduler.py:allocate_or_preempt", "swapping_scheduler.py:select_preemption"):
        function = functions[f"solutions/core/sched/{name}"]
        calls = {node.func.id for node in ast.walk(function) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Name)}
        assert "select_victim" in calls, f"{name} does not ask select_victim for its victim"


def test_a_victim_rule_written_twice_is_caught():
    """The check can fail: a copy of the FCFS rule in another function is a second victim rule."""
    copy = ast.parse("def pick(scheduler):\n    return scheduler.running[-1]\n").body[0]
    assert reads_running_order(copy)
    keyed = ast.parse("def pick(s):\n    return max(s.running, key=lambda q: q.priority)\n").body[0]
    assert reads_running_order(keyed)
    assert not reads_running_order(ast.parse("def f(s):\n    return len(s.running), s.running[i]\n").body[0])


def test_host_blocks_are_freed_only_by_the_kv_cache_manager():
    """The swap pool's blocks are taken and freed by `KVCacheManager` alone (`swap_out`, `swap_in`,
    `free_swapped`): no scheduler, beam search or other module calls a method of `swap_pool` but to read it."""
    found = []
    for path in sorted(SOLUTIONS.rglob("*.py")):
        if path == SOLUTIONS / "core" / "kv_cache_manager.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "swap_pool"):
                found.append(f"{path.relative_to(SOLUTIONS.parent)}:{node.lineno} calls swap_pool.{node.func.attr}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("swap_in", "swap_out"):
                found.append(f"{path.relative_to(SOLUTIONS.parent)}:{node.lineno} calls {node.func.id} on the pools")
    found = [line for line in found if not line.startswith("solutions/kv_offload/swap.py")]
    assert not found, "host blocks moved or freed outside the KV cache manager:\n" + "\n".join(found)
