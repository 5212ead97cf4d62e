"""The site's picture of the engine's spine (docs/spine.md) is the one a live engine draws today, and the engine's
layers point down only."""

import ast
from pathlib import Path

from grading.spine import PAGE, build

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
