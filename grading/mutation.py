"""Mutation testing: every plausible wrong answer in tests/mutants/ch<NN>.py must fail a test of its exercise,
and the one named for each exercise in `CAPSTONE_MUTANTS` must also make the chapter's capstone fail.

    python -m grading.mutation 01_naive_attention          # a table: mutant, exercise, tests failed
    python -m grading.mutation 01_naive_attention --json   # the same as one JSON object

All mutants run in this one process (one `pytest.main` each), so torch is imported and the model loaded once.
"""

import argparse
import json

import pytest

from grading import chapter_dir
from grading.impl import load_capstone_mutants, load_mutants
from grading.plugin import IN_PROCESS_OPTIONS, ResultCollector

CAPSTONE = "capstone"  # the exercise marker of a chapter's capstone tests


def _run(test_file: str, mutant: str, exercise: str) -> tuple[int, list[str]]:
    """(tests passed, tests failed) of `exercise` with `mutant` swapped in."""
    collector = ResultCollector()
    args = [test_file, f"--impl=mutant:{mutant}", f"--exercise={exercise}", *IN_PROCESS_OPTIONS]
    pytest.main(args, plugins=[collector])
    failed = [test for test, outcome, _ in collector.results if outcome == "failed"]
    return sum(outcome == "passed" for _, outcome, _ in collector.results), failed


def run_mutants(chapter: str) -> dict[str, dict[str, object]]:
    """mutant name -> {"exercise", "passed", "failed", "killed_by"[, "capstone_passed", "capstone_failed"]}."""
    test_file = str(chapter_dir(chapter) / f"test_{chapter}.py")
    capstone_mutants = set(load_capstone_mutants(chapter).values())
    summary: dict[str, dict[str, object]] = {}
    for name, replacement in load_mutants(chapter).items():
        (exercise,) = replacement
        passed, failed = _run(test_file, name, exercise)
        summary[name] = {"exercise": exercise, "passed": passed, "failed": len(failed), "killed_by": failed}
        if name in capstone_mutants:
            passed, failed = _run(test_file, name, CAPSTONE)
            summary[name] |= {"capstone_passed": passed, "capstone_failed": len(failed)}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m grading.mutation", description=__doc__.splitlines()[0])
    parser.add_argument("chapter", help="e.g. 01_naive_attention")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    summary = run_mutants(args.chapter)
    if args.json:
        print(json.dumps(summary))
        return
    for name, row in summary.items():
        verdict = "killed" if row["failed"] else "SURVIVED"
        line = f"{verdict:8}  {name:<48} {row['exercise']:<24} {row['failed']} of {row['failed'] + row['passed']} tests failed"
        if "capstone_failed" in row:
            line += f"; capstone {'FAILS' if row['capstone_failed'] else 'PASSES (should fail)'}"
        print(line)


if __name__ == "__main__":
    main()
