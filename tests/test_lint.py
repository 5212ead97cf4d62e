"""The course's code passes the linter: `ruff check solutions kernels` reports nothing.

The rules are those of `[tool.ruff.lint]` in pyproject.toml (pyflakes, pycodestyle's E4/E7/E9 and lines of at most
120 columns). Only the `solutions/` and `kernels/` folders are linted for now; `tests/`, `chapters/`,
`benchmarks/` and `grading/` are not yet. ruff runs as `python -m ruff` from this interpreter's environment
(pinned in requirements.txt).
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINTED = ("solutions", "kernels")


def test_ruff_check_passes():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", *LINTED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"ruff check {' '.join(LINTED)} failed:\n{result.stdout}{result.stderr}"
