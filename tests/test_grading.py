"""The grading tests can fail: shipped stubs fail every test, mutants fail their exercise, signatures match.

(That the reference passes every chapter test is the main test command itself: `pytest --impl=reference`.)
"""

import functools
import inspect
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import nbformat
import pytest

from grading import CHAPTERS
from grading.impl import ROOT, load_capstone_mutants, load_mutants
from grading.notebook import exercise_cells, load_exercises
from grading.notebooks import chapter_reference

CHAPTER_NAMES = sorted(p.name for p in CHAPTERS.iterdir() if (p / f"{p.name}.ipynb").exists())


def run_chapter(chapter: str, *options: str, tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Run a chapter's tests in a subprocess; test id -> (outcome, failure message)."""
    report = tmp_path / f"{chapter}-{len(list(tmp_path.iterdir()))}.xml"
    cmd = [sys.executable, "-m", "pytest", str(CHAPTERS / chapter), "-q", f"--junitxml={report}", *options]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert report.exists(), f"pytest crashed instead of reporting:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = {}
    for case in ET.parse(report).iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        outcome = "failed" if problem is not None else "skipped" if skipped is not None else "passed"
        message = (problem.get("message", "") + (problem.text or "")) if problem is not None else ""
        results[f"{case.get('classname')}::{case.get('name')}"] = (outcome, message)
    return results


def is_stub(source: str) -> bool:
    return "NotImplementedError" in source


@pytest.mark.parametrize("chapter", CHAPTER_NAMES)
def test_shipped_stubs_fail_every_test(chapter, tmp_path):
    nb = nbformat.read(CHAPTERS / chapter / f"{chapter}.ipynb", as_version=4)
    edited = [c.source.splitlines()[0] for c in exercise_cells(nb) if not is_stub(c.source)]
    assert not edited, f"{chapter}'s notebook has filled-in exercise cells {edited}; this test checks the shipped stubs"
    results = run_chapter(chapter, tmp_path=tmp_path)
    assert results, f"no tests ran for {chapter}"
    passed = [t for t, (outcome, _) in results.items() if outcome != "failed"]
    assert not passed, f"these tests do not fail on the shipped stubs: {passed}"
    unexplained = [t for t, (_, message) in results.items() if "not implemented" not in message]
    assert not unexplained, f"these tests fail on stubs without saying the exercise is not implemented: {unexplained}"


@functools.cache
def mutation_summary(chapter: str) -> dict[str, dict[str, object]]:
    """`python -m grading.mutation <chapter> --json`, run once per chapter for the tests below."""
    cmd = [sys.executable, "-m", "grading.mutation", chapter, "--json"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("chapter", CHAPTER_NAMES)
def test_every_mutant_fails_a_test_of_its_exercise(chapter):
    summary = mutation_summary(chapter)
    assert summary.keys() == load_mutants(chapter).keys()
    for name, row in summary.items():
        print(f"{chapter} mutant {name}: {row['failed']} of {row['failed'] + row['passed']} tests of {row['exercise']} fail")
    not_run = [name for name, row in summary.items() if row["failed"] + row["passed"] == 0]
    survivors = [name for name, row in summary.items() if row["failed"] == 0]
    assert not not_run, f"no test of their exercise ran for mutants {not_run}"
    assert not survivors, f"these mutants pass every test of their exercise: {survivors}"


@pytest.mark.parametrize("chapter", CHAPTER_NAMES)
def test_every_exercise_has_at_least_three_mutants(chapter):
    per_exercise = Counter(exercise for replacement in load_mutants(chapter).values() for exercise in replacement)
    few = {name: per_exercise[name] for name in chapter_reference(chapter) if per_exercise[name] < 3}
    assert not few, f"exercises with fewer than 3 mutants: {few}"


@pytest.mark.parametrize("chapter", CHAPTER_NAMES)
def test_capstone_fails_when_any_one_piece_is_a_mutant(chapter):
    """The capstone runs the chapter's pieces together: one mutant of each exercise, alone, must break it."""
    source = (CHAPTERS / chapter / f"test_{chapter}.py").read_text()
    assert 'exercise("capstone")' in source, f"{chapter} has no test marked @pytest.mark.exercise('capstone')"
    capstone_mutants, mutants = load_capstone_mutants(chapter), load_mutants(chapter)
    missing = [name for name in chapter_reference(chapter) if name not in capstone_mutants]
    assert not missing, f"CAPSTONE_MUTANTS names no mutant for exercises {missing}"
    summary = mutation_summary(chapter)
    for exercise, mutant in capstone_mutants.items():
        assert exercise in mutants.get(mutant, {}), f"CAPSTONE_MUTANTS[{exercise!r}] = {mutant!r} is not a mutant of {exercise}"
        row = summary[mutant]
        assert row["capstone_passed"] + row["capstone_failed"] > 0, f"no capstone test ran for mutant {mutant}"
        assert row["capstone_failed"] > 0, f"the capstone passes with {exercise} replaced by mutant {mutant}"


def normalized_signature(obj: object) -> str:
    """The signature with module paths stripped from annotations (stub and reference import them differently)."""
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", str(inspect.signature(obj)))


def public_methods(cls: type) -> dict[str, object]:
    return {name: fn for name, fn in vars(cls).items() if inspect.isfunction(fn) and not name.startswith("_") or name == "__init__"}


@pytest.mark.parametrize("chapter", CHAPTER_NAMES)
def test_stub_signatures_equal_the_reference(chapter):
    reference = chapter_reference(chapter)
    loaded = load_exercises(CHAPTERS / chapter / f"{chapter}.ipynb")
    assert not loaded.errors, loaded.errors
    for name, ref in reference.items():
        stub = getattr(loaded.module, name, None)
        assert stub is not None, f"the notebook has no exercise cell defining {name}"
        if inspect.isclass(ref):
            ref_methods, stub_methods = public_methods(ref), public_methods(stub)
            assert sorted(stub_methods) == sorted(ref_methods), f"{name}: methods differ"
            for method, fn in ref_methods.items():
                assert normalized_signature(stub_methods[method]) == normalized_signature(fn), f"{name}.{method}"
        else:
            assert normalized_signature(stub) == normalized_signature(ref), name


@pytest.mark.parametrize("chapter", CHAPTER_NAMES)
def test_every_exercise_is_graded(chapter):
    source = (CHAPTERS / chapter / f"test_{chapter}.py").read_text()
    for name in chapter_reference(chapter):
        assert f'exercise("{name}")' in source, f"no test is marked @pytest.mark.exercise({name!r})"
