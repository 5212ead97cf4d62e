"""Every chapter notebook runs top to bottom under nbval with the reference's source in its exercise cells, every
`check()` passes, and the cells tagged `nbval-check-output` reproduce their stored outputs.

This is where the reference passes every chapter's grading tests, once: each `check("exercise")` cell grades its
exercise in the notebook's own namespace, the capstone runs those definitions together in the engine, and the last
cell's `check()` grades every test not graded above; its checked output, "all N tests passed", counts the chapter's
tests as collected in that run, so no test is left out.

The shipped notebook stores that run's outputs but for its answers (`is_answer`: check cells, predict cells); the
expected outputs of those nbval checks live in grading/expected_outputs/<chapter>.json, and `injected_notebook`
puts them back into the copy nbval runs.
"""

import subprocess
import sys
import time

import nbformat
import pytest

from grading import CHAPTERS
from grading.notebook import CHECK_OUTPUT_TAG, EXERCISE_TAG, is_answer
from grading.notebooks import expected_outputs, injected_notebook

CHAPTER_NAMES = sorted(p.name for p in CHAPTERS.iterdir() if (p / f"{p.name}.ipynb").exists())


@pytest.mark.parametrize("chapter", CHAPTER_NAMES)
def test_notebook_runs_under_nbval_with_the_reference(chapter, tmp_path):
    notebook = tmp_path / f"{chapter}.ipynb"
    nbformat.write(injected_notebook(chapter), notebook)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # keep the repository's options out of this run
    cmd = [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "--nbval-cell-timeout=300",
           "-p", "no:cacheprovider", "-q", str(notebook)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    print(f"{chapter}: nbval in {seconds:.1f} s")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("chapter", CHAPTER_NAMES)
def test_shipped_notebook_stores_the_outputs_of_a_reference_run(chapter):
    """Every cell but the stubs and the answers stores the reference run's outputs; the answers nbval checks have
    theirs in the side file, and nbval's copy gets them back."""
    nb = nbformat.read(CHAPTERS / chapter / f"{chapter}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    exercises = [c for c in code if EXERCISE_TAG in c.metadata.get("tags", [])]
    assert exercises, "a chapter has exercises"
    bare = exercises + [c for c in code if is_answer(c)]
    assert all(not c.outputs and c.execution_count is None for c in bare), "exercise and answer cells ship bare"
    unexecuted = [c.source.splitlines()[0] for c in code if c not in bare and c.execution_count is None]
    assert not unexecuted, f"cells without stored outputs (run `python -m grading.notebooks {chapter}`): {unexecuted}"
    expected = expected_outputs(chapter)
    checked = [c.id for c in code if is_answer(c) and CHECK_OUTPUT_TAG in c.metadata.get("tags", [])]
    assert list(expected) == checked, "the side file holds exactly the checked answers' outputs, in notebook order"
    assert all(expected.values()), "every checked answer has an expected output"
    outputs = [o for c in code for o in c.outputs] + [o for found in expected.values() for o in found]
    errors = [o for o in outputs if o["output_type"] == "error"]
    assert not errors, f"stored outputs contain errors: {[e['ename'] for e in errors]}"
    assert any(o.get("data", {}).get("image/png") for c in code for o in c.outputs), "a chapter shows a plot"
    assert any(CHECK_OUTPUT_TAG in c.metadata.get("tags", []) and c.outputs for c in injected_notebook(chapter).cells
               if c.cell_type == "code"), "some outputs are checked by nbval"
    assert any("tests passed" in o.get("text", "") for found in expected.values() for o in found), \
        "the final check()'s verdict is checked by nbval"
