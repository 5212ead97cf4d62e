"""The grading tests can fail: shipped stubs fail every test, mutants fail their exercise, signatures match.

(That the reference passes every chapter test is proved by each notebook's own `check()` cells under nbval:
tests/test_notebooks.py.)
"""

import inspect
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

from grading import CHAPTERS
from grading.impl import ROOT, load_capstone_mutants, load_mutants
from grading.notebook import exercise_cells, load_exercises
from grading.notebooks import chapter_reference

CHAPTER_NAMES = sorted(p.name for p in CHAPTERS.iterdir() if (p / f"{p.name}.ipynb").exists())


# The stub run and every chapter's mutation run are separate processes started together, a few at a time: much of a
# mutation run waits (a mutant that hangs is caught by a bounded wait: a collective's timeout, a capstone's), so they
# overlap well; each computes on one torch thread, so two busy processes never make each other's threads wait.
RUNS_AT_ONCE = 4
RUN_TIMEOUT_SECONDS = 900
# Longest first (seconds on a 2-core machine, alone): 09 110 (mostly waiting), 07 95, 05 85, 06 50, the rest < 35.
MUTATION_ORDER = ["09", "07", "05", "12", "06", "03", "08", "11", "10", "02", "04", "01"]


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)


STUB_TEST, RUN_TESTS = "test_shipped_stubs_fail_every_test", ("test_every_mutant_fails", "test_capstone_fails_when")


@pytest.fixture(scope="session")
def grading_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future]:
    """The runs this session's tests need, all started at the first of them: "stubs" (every chapter's tests on its
    shipped notebook, as a learner's `pytest chapters` grades it, in one process) and, per chapter, `python -m
    grading.mutation <chapter> --json`. Each test then waits for its own."""
    selected = [item for item in request.session.items if item.path == Path(__file__)]
    chapters = {item.callspec.params["chapter"] for item in selected if item.originalname.startswith(RUN_TESTS)}
    pool = ThreadPoolExecutor(max_workers=RUNS_AT_ONCE, thread_name_prefix="grading-run")
    runs: dict[str, Future] = {}
    if any(item.originalname == STUB_TEST for item in selected):
        report = tmp_path_factory.getbasetemp() / "stubs.xml"
        runs["stubs"] = pool.submit(_run, [sys.executable, "-m", "pytest", str(CHAPTERS), "-q", f"--junitxml={report}"])
    for chapter in sorted(chapters, key=lambda c: MUTATION_ORDER.index(c[:2]) if c[:2] in MUTATION_ORDER else -1):
        runs[chapter] = pool.submit(_run, [sys.executable, "-m", "grading.mutation", chapter, "--json"])
    pool.shutdown(wait=False)  # the runs go on while the tests wait
    return runs


@pytest.fixture(scope="session")
def shipped_stub_results(grading_runs, tmp_path_factory) -> dict[str, dict[str, tuple[str, str]]]:
    """chapter -> test id -> (outcome, failure message) of the stub run."""
    proc = grading_runs["stubs"].result()
    report = tmp_path_factory.getbasetemp() / "stubs.xml"
    assert report.exists(), f"pytest crashed instead of reporting:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results: dict[str, dict[str, tuple[str, str]]] = {}
    for case in ET.parse(report).iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        outcome = "failed" if problem is not None else "skipped" if skipped is not None else "passed"
        message = (problem.get("message", "") + (problem.text or "")) if problem is not None else ""
        chapter = next(name for name in CHAPTER_NAMES if f"test_{name}" in case.get("classname", ""))
        results.setdefault(chapter, {})[f"{case.get('classname')}::{case.get('name')}"] = (outcome, message)
    return results


def is_stub(source: str) -> bool:
    return "NotImplementedError" in source


@pytest.mark.parametrize("chapter", CHAPTER_NAMES)
@pytest.mark.timeout(RUN_TIMEOUT_SECONDS)
def test_shipped_stubs_fail_every_test(chapter, grading_runs, shipped_stub_results):
    nb = nbformat.read(CHAPTERS / chapter / f"{chapter}.ipynb", as_version=4)
    edited = [c.source.splitlines()[0] for c in exercise_cells(nb) if not is_stub(c.source)]
    assert not edited, f"{chapter}'s notebook has filled-in exercise cells {edited}; this test checks the shipped stubs"
    results = shipped_stub_results.get(chapter, {})
    assert results, f"no tests ran for {chapter}"
    passed = [t for t, (outcome, _) in results.items() if outcome != "failed"]
    assert not passed, f"these tests do not fail on the shipped stubs: {passed}"
    unexplained = [t for t, (_, message) in results.items() if "not implemented" not in message]
    assert not unexplained, f"these tests fail on stubs without saying the exercise is not implemented: {unexplained}"


def mutation_summary(runs: dict[str, Future], chapter: str) -> dict[str, dict[str, object]]:
    """The JSON of the chapter's `python -m grading.mutation` run."""
    proc = runs[chapter].result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("chapter", CHAPTER_NAMES)
@pytest.mark.timeout(RUN_TIMEOUT_SECONDS)
def test_every_mutant_fails_a_test_of_its_exercise(chapter, grading_runs):
    summary = mutation_summary(grading_runs, chapter)
    assert summary.keys() == load_mutants(chapter).keys()
    for name, row in summary.items():
        killed_by = row["killed_by"] or "nothing"
        print(f"{chapter} mutant {name}: killed by {killed_by} ({row['passed']} tests passed before)")
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
@pytest.mark.timeout(RUN_TIMEOUT_SECONDS)
def test_capstone_fails_when_any_one_piece_is_a_mutant(chapter, grading_runs):
    """The capstone runs the chapter's pieces together: one mutant of each exercise, alone, must break it."""
    source = (CHAPTERS / chapter / f"test_{chapter}.py").read_text()
    assert 'exercise("capstone")' in source, f"{chapter} has no test marked @pytest.mark.exercise('capstone')"
    capstone_mutants, mutants = load_capstone_mutants(chapter), load_mutants(chapter)
    missing = [name for name in chapter_reference(chapter) if name not in capstone_mutants]
    assert not missing, f"CAPSTONE_MUTANTS names no mutant for exercises {missing}"
    summary = mutation_summary(grading_runs, chapter)
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
