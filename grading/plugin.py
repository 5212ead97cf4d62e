"""The pytest side of grading: `--impl`, `--exercise`, the `impl` fixture and the per-exercise summary.

    pytest chapters/01_naive_attention                    # grade your saved notebook
    pytest chapters/01_naive_attention --exercise rms_norm  # just one exercise
    pytest chapters --impl=reference                      # the reference engine must pass everything
    pytest chapters/01_naive_attention --impl=mutant:rms_norm_without_eps   # a known-wrong variant must fail

A chapter's test file declares `REFERENCE = {"exercise_name": reference_object, ...}` and marks each test
with `@pytest.mark.exercise("exercise_name")`.
"""

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from grading.impl import Implementation, load_mutants
from grading.notebook import load_exercises

# Set by `check()` in a notebook: the kernel's globals, graded without saving the notebook.
LIVE_NAMESPACE: dict[str, Any] | None = None
_IMPL_KINDS = "learner (default), reference, live, mutant:<name>"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("grading")
    group.addoption("--impl", default="learner", help=f"what the chapter tests grade: {_IMPL_KINDS}")
    group.addoption("--exercise", default=None, help="run only the tests of this exercise")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "exercise(name): the chapter exercise this test grades")
    impl = config.getoption("--impl")
    if impl not in ("learner", "reference", "live") and not impl.startswith("mutant:"):
        raise pytest.UsageError(f"--impl={impl!r} is not one of: {_IMPL_KINDS}")
    config.stash[_RESULTS] = defaultdict(lambda: [0, 0])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = config.getoption("--exercise")
    if wanted is None:
        return
    keep = [item for item in items if _exercise_of(item) == wanted]
    if not keep:
        raise pytest.UsageError(f"--exercise={wanted!r} matches no test")
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


def _exercise_of(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("exercise")
    return marker.args[0] if marker else None


_NOTEBOOK_CACHE: dict[Path, Implementation] = {}


@pytest.fixture
def impl(request: pytest.FixtureRequest) -> Implementation:
    """The implementation a chapter test grades, chosen by `--impl`."""
    reference: dict[str, Any] = request.module.REFERENCE
    kind: str = request.config.getoption("--impl")
    chapter_dir = request.path.parent
    if kind == "reference":
        return Implementation("reference", reference)
    if kind == "live":
        if LIVE_NAMESPACE is None:
            raise pytest.UsageError("--impl=live is set by check() inside a notebook")
        return Implementation("notebook kernel", {n: LIVE_NAMESPACE[n] for n in reference if n in LIVE_NAMESPACE})
    if kind.startswith("mutant:"):
        mutants = load_mutants(chapter_dir.name)
        name = kind.removeprefix("mutant:")
        if name not in mutants:
            raise pytest.UsageError(f"mutant {name!r} is not one of {sorted(mutants)}")
        return Implementation(f"mutant {name}", {**reference, **mutants[name]})
    notebook = chapter_dir / f"{chapter_dir.name}.ipynb"
    if notebook not in _NOTEBOOK_CACHE:
        loaded = load_exercises(notebook)
        objects = {n: getattr(loaded.module, n) for n in reference if hasattr(loaded.module, n)}
        _NOTEBOOK_CACHE[notebook] = Implementation(f"notebook {notebook.name}", objects, loaded.errors)
    return _NOTEBOOK_CACHE[notebook]


_RESULTS = pytest.StashKey[defaultdict]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    exercise = _exercise_of(item)
    if exercise and (report.when == "call" or (report.when == "setup" and report.failed)):
        item.config.stash[_RESULTS][exercise][0 if report.passed else 1] += 1
    return report


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    results = config.stash[_RESULTS]
    if not results:
        return
    terminalreporter.section(f"exercises ({config.getoption('--impl')})")
    for exercise, (passed, failed) in results.items():
        mark = "PASS" if failed == 0 else "FAIL"
        terminalreporter.write_line(f"  {mark}  {exercise:<28} {passed} passed, {failed} failed")


# The plugins a caller that runs `pytest.main` in its own process turns off (`check()`, `python -m grading.mutation`):
# it reports results itself, and unraisableexception would gc.collect() the whole heap, the model's included, as
# each session ends (half the time of a chapter's mutation run: 03's took 50 s with it, 25 s without).
IN_PROCESS_OPTIONS = ["-p", "no:terminal", "-p", "no:warnings", "-p", "no:unraisableexception"]


class ResultCollector:
    """A plugin object for `pytest.main(plugins=[...])` that keeps each test's outcome, for callers that
    report results themselves (`check()` in a notebook, `python -m grading.mutation`). Tests whose node ids are
    in `skip` are deselected (`check()`'s ledger: they passed earlier on the same definitions)."""

    def __init__(self, skip: set[str] | None = None) -> None:
        self.results: list[tuple[str, str, str]] = []  # (test name, outcome, failure text)
        self.passed: list[str] = []  # node ids of the tests that passed
        self.collected = 0  # tests selected to run, with the ones skipped
        self.skipped = 0
        self._skip = skip or set()

    @pytest.hookimpl(trylast=True)  # after `--exercise` has made its selection
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        self.collected = len(items)
        done = [item for item in items if item.nodeid in self._skip]
        if done:
            config.hook.pytest_deselected(items=done)
            items[:] = [item for item in items if item.nodeid not in self._skip]
        self.skipped = len(done)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or report.failed:
            name = report.nodeid.split("::")[-1]
            self.results.append((name, report.outcome, report.longreprtext if report.failed else ""))
        if report.when == "call" and report.passed:
            self.passed.append(report.nodeid)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.results.append((report.nodeid, "failed", report.longreprtext))
