"""Grading for the course's notebooks: load exercise cells, run a chapter's tests, report per exercise.

In a notebook:

    from grading import checker
    check = checker("01_naive_attention")
    check("rms_norm")      # the tests of one exercise, against the cells you have run (saved or not)
    check()                # the whole chapter

In a terminal: `pytest chapters/01_naive_attention` grades the saved notebook (see grading/plugin.py).
"""

import inspect
from collections.abc import Callable
from pathlib import Path

from grading.checks import expect_close, expect_equal
from grading.impl import ROOT, ExerciseError

CHAPTERS = ROOT / "chapters"

__all__ = ["CHAPTERS", "ExerciseError", "checker", "chapter_dir", "expect_close", "expect_equal"]


def chapter_dir(chapter: str) -> Path:
    path = CHAPTERS / chapter
    if not (path / f"test_{chapter}.py").exists():
        known = sorted(p.name for p in CHAPTERS.iterdir() if p.is_dir() and p.name[:2].isdigit())
        raise ValueError(f"chapter {chapter!r} not found; chapters: {', '.join(known)}")
    return path


def checker(chapter: str) -> Callable[[str | None], None]:
    """A `check(exercise=None)` bound to one chapter, grading the caller's live globals."""
    test_file = chapter_dir(chapter) / f"test_{chapter}.py"

    def check(exercise: str | None = None) -> None:
        import pytest

        from grading import plugin

        plugin.LIVE_NAMESPACE = inspect.currentframe().f_back.f_globals  # the notebook's namespace
        args = [str(test_file), "--impl=live", "-q", "--tb=short", "--no-header", f"--rootdir={ROOT}"]
        if exercise is not None:
            args.append(f"--exercise={exercise}")
        try:
            code = pytest.main(args)
        finally:
            plugin.LIVE_NAMESPACE = None
        if code != 0:
            what = f"exercise {exercise!r}" if exercise else f"chapter {chapter}"
            raise ExerciseError(f"{what}: some tests failed (details above)") from None
        print(f"All tests passed for {exercise or chapter}.")

    return check
