"""The picture of the engine's spine on the course site (docs/spine.md), drawn from a live engine.

    python -m grading.spine        # rewrite docs/spine.md

Each object is reached from `LLM` by the attribute path shown, and its class and file are read off the object
itself, so the picture cannot drift from the code: `tests/test_spine.py` draws it again and requires the stored
page to be the same. One row is not an object: the engine core, which its client keeps to itself (the rows under
it are the parts the client answers for); that row names `EngineCore`, the class whose step the page shows. The
vLLM column is the file where vLLM keeps the same object (vLLM 0.32).
"""

import inspect
from pathlib import Path

import solutions

PAGE = Path(__file__).resolve().parents[1] / "docs" / "spine.md"
SOLUTIONS = Path(solutions.__file__).resolve().parent

CLIENT = "llm_engine.engine_core"  # the engine-core client: it answers for the in-process core's parts below
# (attribute path from the LLM, what it owns or does, vLLM's file for the same object); the path None is the client's
# engine core itself, which no caller outside `solutions/engine/` reaches: the rows under it are read through the client
EDGES = [
    ("llm_engine", "the offline front end: no scheduler, no model", "vllm/v1/engine/llm_engine.py"),
    ("llm_engine.vllm_config", "every option, checked and resolved once (`EngineArgs.create_engine_config()`)",
     "vllm/config/vllm.py"),
    ("llm_engine.processor", "validates and tokenises a request, once", "vllm/v1/engine/input_processor.py"),
    ("llm_engine.output_processor", "detokenises, checks stop strings, makes `RequestOutput`s",
     "vllm/v1/engine/output_processor.py"),
    (CLIENT, "the client: in-process here, it answers for its core's parts; a process or a thread under `AsyncLLM`",
     "vllm/v1/engine/core_client.py"),
    (None, "owns the step: schedule → execute → sample → update", "vllm/v1/engine/core.py"),
    (f"{CLIENT}.scheduler", "decides each step's batch; `update_from_output`", "vllm/v1/core/sched/scheduler.py"),
    (f"{CLIENT}.scheduler.waiting", "the waiting queue (FCFS or priority)", "vllm/v1/core/sched/request_queue.py"),
    (f"{CLIENT}.scheduler.kv_cache_manager", "blocks for each sequence; prefix caching",
     "vllm/v1/core/kv_cache_manager.py"),
    (f"{CLIENT}.scheduler.kv_cache_manager.block_pool", "the blocks and the free queue", "vllm/v1/core/block_pool.py"),
    (f"{CLIENT}.structured_output_manager", "grammars and their token masks", "vllm/v1/structured_output/__init__.py"),
    (f"{CLIENT}.model_executor", "runs the model on one or several ranks", "vllm/v1/executor/uniproc_executor.py"),
    (f"{CLIENT}.model_executor.model_runner", "inputs, forward pass, sampling", "vllm/v1/worker/gpu_model_runner.py"),
    (f"{CLIENT}.model_executor.model_runner.model", "the Llama-family model", "vllm/model_executor/models/llama.py"),
    (f"{CLIENT}.model_executor.model_runner.kv_cache", "each layer's K and V blocks (vLLM: its `kv_caches`)",
     "vllm/v1/worker/gpu_model_runner.py"),
]


def _resolve(root: object, path: str) -> object:
    for name in path.split("."):
        root = getattr(root, name)
    return root


def _file(cls: type) -> str:
    source = Path(inspect.getsourcefile(cls)).resolve()
    return f"solutions/{source.relative_to(SOLUTIONS).as_posix()}"


def draw(llm: object) -> str:
    """The page: a tree of the objects an `LLM` holds, then the step's own source."""
    from solutions.engine.core import EngineCore, engine_step

    lines = [
        "# The engine's spine",
        "",
        "Which object owns what, from `LLM` down, read off a live engine by `python -m grading.spine` (a test draws "
        "it again and compares), each beside the file where vLLM keeps the same object.",
        "",
        "| object (attribute path from `LLM`) | class | our file | what it owns or does | vLLM |",
        "|---|---|---|---|---|",
        f"| `llm` | `{type(llm).__name__}` | `{_file(type(llm))}` | the offline entry point "
        "| `vllm/entrypoints/llm.py` |",
    ]
    for path, role, vllm_file in EDGES:
        if path is None:  # the in-process client's core: the class it builds, whose step the page shows below
            cls, depth, label = EngineCore, CLIENT.count(".") + 1, "its engine core"
        else:  # the core's parts (reached through the client) are drawn under the core
            cls, depth = type(_resolve(llm, path)), path.count(".") + path.startswith(f"{CLIENT}.")
            label = "`." + path.rsplit(".", 1)[-1] + "`"
        name = "&nbsp;&nbsp;" * depth + "└ " + label
        lines.append(f"| {name} | `{cls.__name__}` | `{_file(cls)}` | {role} | `{vllm_file}` |")
    lines += [
        "",
        "The server's `AsyncLLM` (`solutions/engine/async_llm.py`, vLLM's `vllm/v1/engine/async_llm.py`) has the same "
        "processor and output processor, and an `MPClient` or `ThreadClient` whose engine core, an `EngineCoreProc`, "
        "runs the same step in a busy loop of its own.",
        "",
        "## One step, as `EngineCore.step` runs it",
        "",
        "```python",
        inspect.getsource(engine_step).rstrip(),
        "```",
        "",
        "Then `EngineCore.post_step`: with speculative decoding, the drafts the runner proposed after sampling "
        "(`model_executor.take_draft_token_ids()`) go to `scheduler.update_draft_token_ids`, for the next step.",
        "",
    ]
    return "\n".join(lines)


def build() -> str:
    from grading.tiny_models import tiny_checkpoint
    from solutions import LLM

    return draw(LLM(model=str(tiny_checkpoint("llama-gqa")), block_size=4, num_kv_blocks=8))


if __name__ == "__main__":
    PAGE.write_text(build())
    print(f"wrote {PAGE}")
