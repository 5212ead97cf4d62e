"""Read a chapter notebook the way the grader sees it.

Exercise cells are code cells tagged `exercise`; they hold only definitions. The grader builds a fresh
module from the notebook's import statements plus those cells — no demo cell runs — so grading is fast
and only the learner's definitions are judged. A cell that fails to compile or run is recorded against
the names it defines, and the rest still load.
"""

import ast
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

EXERCISE_TAG = "exercise"
_DEF_PATTERN = re.compile(r"^(?:async\s+)?(?:def|class)\s+(\w+)", re.MULTILINE)


def exercise_cells(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [c for c in nb.cells if c.cell_type == "code" and EXERCISE_TAG in c.metadata.get("tags", [])]


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


def _import_line(name: str, obj: object) -> str:
    alias = "" if obj.__name__ == name else f" as {name}"
    return f"from {obj.__module__} import {obj.__name__}{alias}"


def inject_reference(nb: nbformat.NotebookNode, reference: dict[str, object]) -> nbformat.NotebookNode:
    """A copy of `nb` whose exercise cells import the reference instead of defining stubs."""
    injected = nbformat.from_dict(nb)
    for cell in exercise_cells(injected):
        names = defined_names(cell.source)
        missing = [n for n in names if n not in reference]
        if missing:
            raise ValueError(f"exercise cell defines {missing}, which the chapter's REFERENCE does not list")
        cell.source = "\n".join(_import_line(n, reference[n]) for n in names)
    return injected
