"""The grader survives the learner: a syntax error, an exception or an endless loop is reported against its
exercise, and the other exercises are still graded. And the learner's own definitions, in the notebook's module,
run together: a notebook whose exercise cells hold the reference's source passes every chapter's capstone."""

import ast
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from grading import CHAPTERS
from grading.impl import ROOT
from grading.notebook import defined_names, exercise_cells
from grading.notebooks import chapter_reference

CHAPTER = "01_naive_attention"


def chapter_with(tmp_path: Path, replacements: dict[str, str], timeout: int = 60) -> Path:
    """A copy of chapter 01 whose exercise cells are the reference, except `replacements` (name -> source)."""
    folder = tmp_path / CHAPTER
    folder.mkdir()
    tests = (CHAPTERS / CHAPTER / f"test_{CHAPTER}.py").read_text()
    assert "pytest.mark.timeout(60)" in tests
    (folder / f"test_{CHAPTER}.py").write_text(tests.replace("pytest.mark.timeout(60)", f"pytest.mark.timeout({timeout})"))
    nb = nbformat.read(CHAPTERS / CHAPTER / f"{CHAPTER}.ipynb", as_version=4)
    reference = chapter_reference(CHAPTER)
    for cell in exercise_cells(nb):
        (name,) = defined_names(cell.source)
        cell.source = replacements.get(name, f"from {reference[name].__module__} import {name}")
    nbformat.write(nb, folder / f"{CHAPTER}.ipynb")
    return folder


def grade(folder: Path, *options: str) -> str:
    cmd = [sys.executable, "-m", "pytest", str(folder), "-p", "grading.plugin", "-q", "--tb=line", *options]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc.stdout + proc.stderr


def test_syntax_error_is_reported_against_its_exercise(tmp_path):
    folder = chapter_with(tmp_path, {"rms_norm": "def rms_norm(x, weight, eps)\n    return x\n"})
    out = grade(folder)
    assert "exercise `rms_norm`: the cell defining 'rms_norm' failed to load (line 1): SyntaxError" in out
    assert "FAIL  rms_norm" in out and "PASS  apply_rope" in out and "PASS  generate_naive" in out


def test_exception_is_reported_with_the_input(tmp_path):
    source = "def repeat_kv(x, num_queries_per_kv):\n    return x[:, :, :, 0]\n"
    out = grade(chapter_with(tmp_path, {"repeat_kv": source}), "--exercise=repeat_kv")
    assert "IndexError" in out and "exercise `repeat_kv` raised IndexError" in out
    assert "on input: (tensor(5, 3, 4) float32, 3)" in out


def test_endless_loop_times_out_as_a_failure_of_its_exercise(tmp_path):
    source = "def apply_rope(x, cos, sin):\n    while True:\n        pass\n"
    out = grade(chapter_with(tmp_path, {"apply_rope": source}, timeout=2), "--exercise=apply_rope")
    assert "Timeout" in out
    assert re.search(r"FAIL  apply_rope\s+0 passed, [1-9]\d* failed", out), out[-2000:]


def test_unknown_impl_is_a_usage_error(tmp_path):
    out = grade(chapter_with(tmp_path, {}), "--impl=teacher")
    assert "--impl='teacher' is not one of: learner (default), reference, live, mutant:<name>" in out


def reference_source(obj: object) -> str:
    """The reference's own source for an exercise cell (a Triton kernel: its Python function, decorator included)."""
    return inspect.getsource(getattr(obj, "fn", obj))


def helper_imports(obj: object, source: str, exercises: set[str]) -> list[str]:
    """Imports of the module-level names `source` uses from the reference's module (its private helpers, type
    aliases, constants) — what a learner who wrote this code would have had to define too. Never another exercise:
    the learner's own definition of it must be the one used."""
    module = sys.modules[getattr(obj, "fn", obj).__module__]
    words = set(re.findall(r"\b\w+\b", source))
    return [f"from {module.__name__} import {name}" for name in sorted(words & module_level_names(module) - exercises)]


def module_level_names(module: object) -> set[str]:
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


@pytest.mark.parametrize("chapter", sorted(p.name for p in CHAPTERS.iterdir() if (p / f"{p.name}.ipynb").exists()))
def test_learner_notebook_with_the_reference_source_passes_its_chapter(chapter, tmp_path):
    """A learner's definitions live in the notebook's own module, not in solutions/: fill every exercise cell with
    the reference's source, grade the saved notebook (learner mode): every test passes, the capstone among them,
    with those definitions, all of them, running together in the engine."""
    folder = tmp_path / chapter
    shutil.copytree(CHAPTERS / chapter, folder)
    nb = nbformat.read(folder / f"{chapter}.ipynb", as_version=4)
    reference = chapter_reference(chapter)
    for cell in exercise_cells(nb):
        sources = [reference_source(reference[name]) for name in defined_names(cell.source)]
        imports = sorted({line for name, src in zip(defined_names(cell.source), sources, strict=True)
                          for line in helper_imports(reference[name], src, set(reference))})
        cell.source = "\n".join(imports) + "\n\n" + "\n\n".join(sources)
    nbformat.write(nb, folder / f"{chapter}.ipynb")
    out = grade(folder)
    assert re.search(r"PASS  capstone\s+[1-9]\d* passed, 0 failed", out), out[-4000:]
    assert "FAIL " not in out and " failed" not in out.splitlines()[-1], out[-4000:]
