"""The site's picture of the engine's spine (docs/spine.md) is the one a live engine draws today, and the engine's
layers point down only."""

import ast
from pathlib import Path

from grading.spine import PAGE, build

SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions"
# Each layer may import itself and the layers below it, never one above (the front ends and entry points on top).
LAYERS = ["entrypoints", "engine", "executor", "worker", "structured_output", "core", "model", "attention"]


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
    names |= {node.module for node in nodes if isinstance(node, ast.ImportFrom) and node.module}
    return {name for name in names if name.startswith("solutions.")}


def test_layers_point_down_only():
    upward = []
    for index, layer in enumerate(LAYERS):
        above = LAYERS[:index]
        for path in sorted((SOLUTIONS / layer).rglob("*.py")):
            for module in imported_modules(path):
                parts = module.split(".")
                if len(parts) > 1 and parts[1] in above or module == "solutions":
                    upward.append(f"{path.relative_to(SOLUTIONS.parent)} imports {module}")
    assert not upward, "lower layers import higher ones:\n" + "\n".join(upward)
