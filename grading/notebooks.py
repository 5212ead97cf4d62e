"""Run chapter notebooks with the reference's source in their exercise cells.

    python -m grading.notebooks                      # execute every chapter, store outputs, keep the stubs
    python -m grading.notebooks 01_naive_attention   # one chapter

The shipped notebooks keep stubs in their exercise cells but carry the outputs of this run, so learners
and the site see what a correct solution prints and plots — except the outputs that are answers (`is_answer`: a
`check(...)` cell's verdict, a `predict` cell's answer to the question above it), which the learner gets by running
the cell. The outputs of those that nbval checks (tagged `nbval-check-output`) are kept outside `chapters/`, in
`grading/expected_outputs/<chapter>.json` (cell id -> outputs), and `injected_notebook` puts them back.

The test suite re-runs the same injected notebooks under nbval and compares the cells tagged `nbval-check-output`
with what is stored. That run is where the reference passes its chapter's tests: each `check(...)` cell grades the
reference's code as a learner who wrote it would have it, the capstone runs it in the engine, and the final
`check()` (a checked output: "all N tests passed") grades every test the cells above did not.
"""

import functools
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import nbformat

from grading import CHAPTERS, chapter_dir
from grading.notebook import CHECK_OUTPUT_TAG, exercise_cells, inject_reference, is_answer

EXPECTED_OUTPUTS = Path(__file__).parent / "expected_outputs"

_NOTEBOOK_METADATA = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python", "pygments_lexer": "ipython3"},
}


@functools.cache
def _chapter_tests(chapter: str) -> Any:
    """A chapter's test file, loaded as a module once per process."""
    path = chapter_dir(chapter) / f"test_{chapter}.py"
    spec = importlib.util.spec_from_file_location(f"reference_of_{chapter}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chapter_reference(chapter: str) -> dict[str, Any]:
    """The `REFERENCE` mapping declared by a chapter's test file."""
    return _chapter_tests(chapter).REFERENCE


def expected_outputs(chapter: str) -> dict[str, list[dict]]:
    """Cell id -> the reference run's outputs, for the checked cells whose outputs the shipped notebook omits."""
    path = EXPECTED_OUTPUTS / f"{chapter}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def injected_notebook(chapter: str) -> nbformat.NotebookNode:
    """The chapter's notebook with the reference's source in its exercise cells, and the expected outputs of its
    checked answer cells put back for nbval."""
    nb = nbformat.read(chapter_dir(chapter) / f"{chapter}.ipynb", as_version=4)
    injected = inject_reference(nb, chapter_reference(chapter))
    expected = expected_outputs(chapter)
    for cell in injected.cells:
        if cell.get("id") in expected:
            cell.outputs = [nbformat.from_dict(output) for output in expected[cell.id]]
            cell.execution_count = 1  # nbval refuses outputs on a cell that has no count, as never run
    return injected


def store_outputs(shipped: nbformat.NotebookNode, run: nbformat.NotebookNode) -> dict[str, list[dict]]:
    """Copy the executed `run`'s outputs into `shipped`, cell by cell, but for its stubs and its answers; return the
    expected outputs of the answers that nbval checks (cell id -> outputs)."""
    shipped.metadata = nbformat.from_dict(_NOTEBOOK_METADATA)  # drop authoring-tool metadata
    stubs = {id(c) for c in exercise_cells(shipped)}
    expected = {}
    for cell, executed in zip(shipped.cells, run.cells, strict=True):
        cell.metadata = nbformat.from_dict({k: v for k, v in cell.metadata.items() if k == "tags"})
        if cell.cell_type != "code":
            continue
        kept = id(cell) not in stubs and not is_answer(cell)
        cell.outputs = executed.outputs if kept else []
        cell.execution_count = executed.execution_count if kept else None
        if is_answer(cell) and CHECK_OUTPUT_TAG in cell.metadata.get("tags", []):
            expected[cell.id] = executed.outputs  # nbformat 4.5 ids: stable across edits of other cells
    return expected


def execute_and_store(chapter: str, timeout: int = 600) -> float:
    """Execute the injected notebook, copy its outputs into the shipped one and the expected outputs of its checked
    answers into the side file; return the seconds it took."""
    from nbclient import NotebookClient

    path = chapter_dir(chapter) / f"{chapter}.ipynb"
    shipped = nbformat.read(path, as_version=4)
    run = injected_notebook(chapter)
    start = time.perf_counter()
    NotebookClient(run, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds = time.perf_counter() - start
    expected = store_outputs(shipped, run)
    nbformat.write(shipped, path)
    EXPECTED_OUTPUTS.mkdir(exist_ok=True)
    (EXPECTED_OUTPUTS / f"{chapter}.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n",
                                                      encoding="utf-8")
    return seconds


def main(argv: list[str]) -> None:
    chapters = argv or sorted(p.name for p in CHAPTERS.iterdir() if (p / f"{p.name}.ipynb").exists())
    for chapter in chapters:
        print(f"{chapter}: executed in {execute_and_store(chapter):.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
