"""Mutation testing: every plausible wrong answer in tests/mutants/ch<NN>.py must fail a test of its exercise,
and the one named for each exercise in `CAPSTONE_MUTANTS` must also make the chapter's capstone fail.

    python -m grading.mutation 01_naive_attention          # a table: mutant, exercise, the test that killed it
    python -m grading.mutation 01_naive_attention --json   # the same as one JSON object

All mutants run in this one process (one `pytest.main` each), so torch is imported and the model loaded once.
A mutant's run stops at its first failing test (`-x`): one failure is what kills it, and the tests after it (often
the ones that wait out a timeout) would only say so again.
"""

import argparse
import json

import pytest

from grading import chapter_dir
from grading.impl import load_capstone_mutants, load_mutants
from grading.plugin import IN_PROCESS_OPTIONS, ResultCollector

CAPSTONE = "capstone"  # the exercise marker of a chapter's capstone tests


def _run(test_file: str, mutant: str, exercise: str) -> tuple[int, list[str]]:
    """(tests passed, the tests that failed) of `exercise` with `mutant` swapped in, up to the first failure."""
    collector = ResultCollector()
    args = [test_file, f"--impl=mutant:{mutant}", f"--exercise={exercise}", "-x", *IN_PROCESS_OPTIONS]
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
        verdict = f"killed by {row['killed_by'][0]}" if row["failed"] else f"SURVIVED all {row['passed']} tests"
        line = f"{name:<48} {row['exercise']:<24} {verdict}"
        if "capstone_failed" in row:
            line += f"; capstone {'FAILS' if row['capstone_failed'] else 'PASSES (should fail)'}"
        print(line)


if __name__ == "__main__":
    main()
