"""Read a chapter notebook the way the grader sees it.

Exercise cells are code cells tagged `exercise`; they hold only definitions. The grader builds a fresh
module from the notebook's import statements plus those cells — no demo cell runs — so grading is fast
and only the learner's definitions are judged. A cell that fails to compile or run is recorded against
the names it defines, and the rest still load.
"""

import ast
import inspect
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

EXERCISE_TAG = "exercise"
PREDICT_TAG = "predict"  # a code cell whose output answers the "Predict first" question above it
CHECK_OUTPUT_TAG = "nbval-check-output"  # nbval compares this cell's output with the expected one
_DEF_PATTERN = re.compile(r"^(?:async\s+)?(?:def|class)\s+(\w+)", re.MULTILINE)
_CHECK_CALL = re.compile(r"(?<![\w.])check\(")


def exercise_cells(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [c for c in nb.cells if c.cell_type == "code" and EXERCISE_TAG in c.metadata.get("tags", [])]


def is_answer(cell: nbformat.NotebookNode) -> bool:
    """Whether a cell's output is an answer, which the shipped notebook must not store: a grading cell (it calls
    `check(`, and says "passed" over the learner's stubs) or a cell tagged `predict` (it answers a "Predict first"
    question before the learner has run anything)."""
    return cell.cell_type == "code" and (
        bool(_CHECK_CALL.search(cell.source)) or PREDICT_TAG in cell.metadata.get("tags", [])
    )


def _strip_magics(source: str) -> str:
    """Blank out IPython-only lines (`%matplotlib`, `!pip`) so the rest parses as Python."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def defined_names(source: str) -> list[str]:
    """Top-level functions and classes a cell defines (by regex when the cell does not even parse)."""
    try:
        tree = ast.parse(_strip_magics(source))
    except SyntaxError:
        return _DEF_PATTERN.findall(source)
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]


def import_statements(nb: nbformat.NotebookNode) -> str:
    """Every top-level import of the notebook's non-exercise code cells, in order."""
    lines = []
    for cell in nb.cells:
        if cell.cell_type != "code" or EXERCISE_TAG in cell.metadata.get("tags", []):
            continue
        try:
            tree = ast.parse(_strip_magics(cell.source))
        except SyntaxError:
            continue
        lines += [ast.unparse(n) for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    return "\n".join(lines)


@dataclass
class LoadedNotebook:
    """A module holding the learner's definitions, plus what failed to load and why."""

    module: types.ModuleType
    errors: dict[str, str] = field(default_factory=dict)  # exercise name -> what went wrong while loading it


def load_exercises(path: Path) -> LoadedNotebook:
    nb = nbformat.read(path, as_version=4)
    name = "learner_" + re.sub(r"\W", "_", path.stem)
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module  # dataclasses and pickling look classes up by module name
    loaded = LoadedNotebook(module)
    exec(compile(import_statements(nb), f"{path.name}:imports", "exec"), module.__dict__)
    for index, cell in enumerate(nb.cells):
        if cell not in exercise_cells(nb):
            continue
        names = defined_names(cell.source)
        try:
            exec(compile(_strip_magics(cell.source), f"{path.name}:cell {index}", "exec"), module.__dict__)
        except Exception as error:  # the learner's cell: report it against its exercises, keep loading
            where = f" (line {error.lineno})" if isinstance(error, SyntaxError) else ""
            for n in names:
                loaded.errors[n] = f"the cell defining {n!r} failed to load{where}: {type(error).__name__}: {error}"
    return loaded


def reference_source(obj: object) -> str:
    """The reference's own source for an exercise cell (a Triton kernel: its Python function, decorator included)."""
    return inspect.getsource(getattr(obj, "fn", obj))


def module_level_names(module: types.ModuleType) -> set[str]:
    """The names a module's source defines or imports at top level (read from the file, so that attributes a
    running process added to the module object — Triton's interpreter adds some — do not count)."""
    names: set[str] = set()
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return {name for name in names if not name.startswith("__")}


def helper_imports(obj: object, source: str, exercises: set[str]) -> list[str]:
    """Imports of the module-level names `source` uses from the reference's module (its private helpers, type
    aliases, constants) — what a learner who wrote this code would have had to define too. Never another exercise:
    the learner's own definition of it must be the one used."""
    module = sys.modules[getattr(obj, "fn", obj).__module__]
    words = set(re.findall(r"\b\w+\b", source))
    return [f"from {module.__name__} import {name}" for name in sorted(words & module_level_names(module) - exercises)]


def inject_reference(nb: nbformat.NotebookNode, reference: dict[str, object]) -> nbformat.NotebookNode:
    """A copy of `nb` whose exercise cells hold the reference's source (with the helpers it uses from its own
    module imported) instead of stubs: the notebook a learner who wrote the reference's code would have, graded
    by its own `check()` cells and run in the engine by its capstone."""
    injected = nbformat.from_dict(nb)
    for cell in exercise_cells(injected):
        names = defined_names(cell.source)
        missing = [n for n in names if n not in reference]
        if missing:
            raise ValueError(f"exercise cell defines {missing}, which the chapter's REFERENCE does not list")
        sources = [reference_source(reference[n]) for n in names]
        imports = sorted({line for n, src in zip(names, sources, strict=True)
                          for line in helper_imports(reference[n], src, set(reference))})
        cell.source = "\n".join(imports) + "\n\n" + "\n\n".join(sources)
    return injected
