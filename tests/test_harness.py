"""The grader survives the learner: a syntax error, an exception or an endless loop is reported against its
exercise, and the other exercises are still graded."""

import re
import subprocess
import sys
from pathlib import Path

import nbformat

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
