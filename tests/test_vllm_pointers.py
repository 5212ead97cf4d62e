"""Every vLLM path the course cites is on the dated list in grading/vllm_paths.py, so a pointer vLLM has moved
(or one never checked) fails here rather than sending a reader to a file that is not there."""

import re
from pathlib import Path

from grading.vllm_paths import CITED, MOVED

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"vllm/[A-Za-z0-9_./-]+\.(?:py|md|rs|cu|cpp|h)|docs/[a-z_/]+\.md")
SCANNED = ("chapters", "solutions", "docs")
SUFFIXES = {".py", ".ipynb", ".md"}


def unlisted(text: str) -> list[str]:
    """The cited vLLM paths in `text` that are not on the list, each with the reason."""
    problems = []
    for path in sorted(set(CITATION.findall(text))):
        if path.startswith("docs/") and (ROOT / path).exists():
            continue  # the course's own docs/ pages, not vLLM's
        if path in MOVED:
            new, commit, date = MOVED[path]
            problems.append(f"{path}: vLLM moved it to {new} (read at {commit[:10]}, {date})")
        elif path not in CITED:
            problems.append(f"{path}: not on grading/vllm_paths.py's list; check it in vLLM and add it")
    return problems


def test_every_cited_vllm_path_is_on_the_list():
    problems = []
    for top in SCANNED:
        for file in sorted((ROOT / top).rglob("*")):
            if file.suffix in SUFFIXES and file.is_file():
                problems += [f"{file.relative_to(ROOT)}: {p}" for p in unlisted(file.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)


def test_the_rule_can_fail():
    assert unlisted("see `vllm/v1/core/sched/scheduler.py` (`Scheduler`)") == []
    assert unlisted("see `vllm/v1/made_up/not_a_file.py`") == [
        "vllm/v1/made_up/not_a_file.py: not on grading/vllm_paths.py's list; check it in vLLM and add it"
    ]
    assert unlisted("`vllm/attention/layer.py::Attention`")[0].startswith(
        "vllm/attention/layer.py: vLLM moved it to vllm/model_executor/layers/attention/attention.py"
    )


def test_the_list_is_dated_and_moved_paths_point_to_listed_files():
    assert all(status in ("current", "v0") and len(commit) == 40 and date for status, commit, date in CITED.values())
    assert all(new in CITED and new not in MOVED for new, _, _ in MOVED.values())
    assert not set(MOVED) & set(CITED)
