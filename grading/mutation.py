"""Mutation testing: every plausible wrong answer in tests/mutants/ch<NN>.py must fail a test of its exercise.

    python -m grading.mutation 01_naive_attention          # a table: mutant, exercise, tests failed
    python -m grading.mutation 01_naive_attention --json   # the same as one JSON object

All mutants run in this one process (one `pytest.main` each), so torch is imported once.
"""

import argparse
import json

import pytest

from grading import chapter_dir
from grading.impl import load_mutants
from grading.plugin import ResultCollector


def run_mutants(chapter: str) -> dict[str, dict[str, object]]:
    """mutant name -> {"exercise", "passed", "failed", "killed_by"} for each mutant of `chapter`."""
    test_file = chapter_dir(chapter) / f"test_{chapter}.py"
    summary: dict[str, dict[str, object]] = {}
    for name, replacement in load_mutants(chapter).items():
        (exercise,) = replacement
        collector = ResultCollector()
        args = [str(test_file), f"--impl=mutant:{name}", f"--exercise={exercise}", "-p", "no:terminal", "-p", "no:warnings"]
        pytest.main(args, plugins=[collector])
        failed = [test for test, outcome, _ in collector.results if outcome == "failed"]
        summary[name] = {
            "exercise": exercise,
            "passed": sum(outcome == "passed" for _, outcome, _ in collector.results),
            "failed": len(failed),
            "killed_by": failed,
        }
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
        print(f"{verdict:8}  {name:<48} {row['exercise']:<24} {row['failed']} of {row['failed'] + row['passed']} tests failed")


if __name__ == "__main__":
    main()
