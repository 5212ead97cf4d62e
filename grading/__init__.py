"""Grading for the course's notebooks: load exercise cells, run a chapter's tests, report per exercise.

In a notebook:

    from grading import checker
    check = checker("01_naive_attention")
    check("rms_norm")      # the tests of one exercise, against the cells you have run (saved or not)
    check()                # the whole chapter (tests that already passed on the same definitions are not rerun)

In a terminal: `pytest chapters/01_naive_attention` grades the saved notebook (see grading/plugin.py).
"""

import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grading.checks import exercising, expect_close, expect_equal, expect_raises
from grading.impl import ROOT, ExerciseError
from grading.plugin import IN_PROCESS_OPTIONS, ResultCollector

CHAPTERS = ROOT / "chapters"

# Notebooks run without a widget library: tqdm's text bars are fine, its warning about it is noise.
warnings.filterwarnings("ignore", message="IProgress not found")

__all__ = [
    "CHAPTERS", "ExerciseError", "checker", "chapter_dir", "exercising", "expect_close", "expect_equal", "expect_raises",
]


def chapter_dir(chapter: str) -> Path:
    path = CHAPTERS / chapter
    if not (path / f"test_{chapter}.py").exists():
        known = sorted(p.name for p in CHAPTERS.iterdir() if p.is_dir() and p.name[:2].isdigit())
        raise ValueError(f"chapter {chapter!r} not found; chapters: {', '.join(known)}")
    return path


def _short(failure: str) -> str:
    """The assertion message of a failure, without the traceback above it."""
    lines = [line[1:].strip() for line in failure.splitlines() if line.startswith("E ")]
    return "\n".join(lines).strip() or failure.strip().splitlines()[-1]


def checker(chapter: str) -> Callable[[str | None], None]:
    """A `check(exercise=None)` bound to one chapter, grading the caller's live globals.

    `check()` grades the whole chapter but does not run again a test that already passed in this kernel on the same
    definitions: the ledger keeps, for each passed test, the exercise objects defined when it ran, and an exercise
    cell run again since (a new object under one of those names) sends that test back to be graded.
    """
    test_file = chapter_dir(chapter) / f"test_{chapter}.py"
    ledger: dict[str, tuple[Any, ...]] = {}  # test node id -> the exercise objects it passed on
    names: list[str] = []

    def check(exercise: str | None = None) -> None:
        import pytest

        from grading import plugin
        from grading.notebooks import chapter_reference

        namespace = inspect.currentframe().f_back.f_globals  # the notebook's namespace
        names[:] = names or list(chapter_reference(chapter))
        definitions = tuple(namespace.get(name) for name in names)
        # A test that passed used only exercises defined then (an undefined one fails it): those must be unchanged.
        graded = {node for node, seen in ledger.items()
                  if all(then is None or then is now for then, now in zip(seen, definitions, strict=True))}
        plugin.LIVE_NAMESPACE = namespace
        collector = ResultCollector(skip=set() if exercise else graded)
        args = [str(test_file), "--impl=live", f"--rootdir={ROOT}", *IN_PROCESS_OPTIONS]
        if exercise is not None:
            args.append(f"--exercise={exercise}")
        try:
            code = pytest.main(args, plugins=[collector])
        finally:
            plugin.LIVE_NAMESPACE = None
        what = f"exercise {exercise!r}" if exercise else f"chapter {chapter}"
        failed = [(name, text) for name, outcome, text in collector.results if outcome != "passed"]
        for name, text in failed:
            print(f"FAILED {name}\n    " + _short(text).replace("\n", "\n    "))
        ledger.update({node: definitions for node in collector.passed})
        ran_nothing = code == pytest.ExitCode.NO_TESTS_COLLECTED and collector.skipped
        if failed or not (code == 0 or ran_nothing) or not collector.collected:
            raise ExerciseError(f"{what}: {len(failed)} of {len(collector.results)} tests failed") from None
        earlier = f" ({collector.skipped} of them passed earlier in this kernel, on the same definitions)"
        print(f"{what}: all {collector.collected} tests passed" + (earlier if collector.skipped else ""))

    return check
