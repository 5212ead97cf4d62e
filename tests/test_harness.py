"""The grader survives the learner: a syntax error, an exception or an endless loop is reported against its
exercise, and the other exercises are still graded. And a saved notebook whose exercise cells hold the reference's
source loads, in the terminal grader, everything that code uses."""

import builtins
import dis
import inspect
import re
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import pytest

from grading import CHAPTERS
from grading.impl import ROOT
from grading.notebook import defined_names, exercise_cells, inject_reference, load_exercises
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


@pytest.mark.quick
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


def globals_read(code: types.CodeType) -> set[str]:
    """The global names a function's code (and the code nested in it) reads when it runs."""
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= globals_read(const)
    return names


def functions_of(obj: object) -> list[types.FunctionType]:
    """The Python functions an exercise object runs: itself (a Triton kernel: its `fn`), or a class's methods."""
    obj = getattr(obj, "fn", obj)
    if not inspect.isclass(obj):
        return [obj]
    found = []
    for value in vars(obj).values():
        value = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if inspect.isfunction(value):
            found.append(value)
    return found


@pytest.mark.parametrize("chapter", sorted(p.name for p in CHAPTERS.iterdir() if (p / f"{p.name}.ipynb").exists()))
def test_saved_notebook_with_the_reference_source_loads_everything_it_uses(chapter, tmp_path):
    """A learner who saves the reference's code in the exercise cells is graded on it by `pytest chapters/NN`.

    That this code passes every test of its chapter, the capstone among them, from the notebook's own namespace, is
    proved once, by the notebook run under nbval (`tests/test_notebooks.py` injects the same source). What the
    terminal grader adds is how it loads a saved notebook: the notebook's imports and its exercise cells, nothing
    else. So here: that load succeeds, and every global name the loaded code reads is defined by it."""
    notebook = tmp_path / f"{chapter}.ipynb"
    nbformat.write(inject_reference(nbformat.read(CHAPTERS / chapter / f"{chapter}.ipynb", as_version=4),
                                    chapter_reference(chapter)), notebook)
    loaded = load_exercises(notebook)
    assert not loaded.errors, loaded.errors
    for name in chapter_reference(chapter):
        obj = getattr(loaded.module, name)
        module = getattr(getattr(obj, "fn", obj), "__module__", None)
        assert module == loaded.module.__name__, f"{name} is defined in {module}, not in the notebook"
        for function in functions_of(obj):
            undefined = globals_read(function.__code__) - set(vars(loaded.module)) - set(dir(builtins))
            assert not undefined, (f"{chapter}: {name} ({function.__qualname__}) reads {sorted(undefined)}, which the "
                                   "saved notebook does not define")
