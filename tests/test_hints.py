"""Hint 2 is a skeleton, not the answer: for every exercise of every chapter, the code of its "Hint 2" (in the
markdown cell after the exercise cell) must not be the reference the chapter's tests grade against.

Both sides are parsed with `ast`, docstrings and decorators dropped. Three rules, any one fails a hint:
- it equals (`ast.dump`) the reference as a whole, a function or class in it, or a function's body;
- it leaves no gap for the learner (no `...` placeholder and no comment such as `# TODO` / `# your code`) and its
  normalised text (`ast.unparse`) is at least 90% similar (difflib) to one of them;
- statement by statement, it shows half or more of the reference's statements. A statement is one line of code as
  `ast.unparse` writes it (a compound statement by its header alone: `if x > 0:`, `for b in blocks:`), compared with
  blank space normalised; a placeholder anywhere in a hint's line (`x = ...`) makes it a different statement, so
  gaps count for the learner and shown lines against the hint, however many `...` the hint carries elsewhere;
- it shows one of the statements the exercise's question is about: the grader lists them per exercise (`DECISIVE`
  in tests/mutants/ch<NN>.py, beside the wrong answers), each of which must be a statement of the reference, so the
  list cannot go stale.

Those statements are the answers, so they stay out of what a learner reads: no file under chapters/ (the test files
a traceback sends them to, the notebooks' cells and stored outputs, the data files) may state one.

Nor may a shipped notebook store an output that is an answer (`grading.notebook.is_answer`): a `check(...)` cell's
verdict ("all 3 tests passed" under a stub), or the output of a cell tagged `predict`, which answers the bold
"**Predict first:**" question before it. Every such question has a `predict` cell after it, and asks the learner to
write the prediction down before running it.
"""

import ast
import difflib
import functools
import inspect
import json
import re
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import nbformat
import pytest

from grading import CHAPTERS
from grading.impl import load_decisive
from grading.notebook import EXERCISE_TAG, PREDICT_TAG, defined_names, exercise_cells, is_answer
from grading.notebooks import chapter_reference

SIMILARITY_LIMIT = 0.9
SHOWN_LIMIT = 0.5  # a hint showing this share of the reference's statements, or more, gives the answer away
_GAP_COMMENT = re.compile(r"#.*\b(todo|your|fill)\b", re.IGNORECASE)
_HINT_2 = re.compile(r"<summary>\s*Hint 2.*?</details>", re.DOTALL)
_CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)
_PREDICT_PROMPT = re.compile(r"\*\*Predict\b")  # a bold "Predict first:" opens a question to answer before running
_WRITE_IT_DOWN = re.compile(r"\bwrite your (prediction|guess)", re.IGNORECASE)


@functools.cache
def chapter_decisive(chapter: str) -> dict[str, list[str]]:
    """exercise -> the statements its question is about, from tests/mutants/ch<NN>.py (not from chapters/)."""
    return load_decisive(chapter)


def chapter_names() -> list[str]:
    return sorted(p.name for p in CHAPTERS.iterdir() if (p / f"{p.name}.ipynb").exists())


def hint_blocks(chapter: str) -> list[tuple[list[str], list[str]]]:
    """(names an exercise cell defines, the code blocks of its Hint 2) per exercise cell, in notebook order. The
    hints are in the first markdown cell after the exercise cell (consecutive exercise cells share it)."""
    nb = nbformat.read(CHAPTERS / chapter / f"{chapter}.ipynb", as_version=4)
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or EXERCISE_TAG not in cell.metadata.get("tags", []):
            continue
        hints = next((c.source for c in nb.cells[i + 1:] if c.cell_type == "markdown"), "")
        hint_2 = _HINT_2.search(hints)
        found.append((defined_names(cell.source), _CODE_BLOCK.findall(hint_2.group(0)) if hint_2 else []))
    return found


def _strip(tree: ast.AST) -> ast.AST:
    """Drop docstrings and decorators in place (a Triton kernel's `@triton.jit` is not part of the answer)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            node.decorator_list = []
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


@functools.cache
def reference_candidates(chapter: str, name: str) -> list[ast.Module]:
    """The reference of exercise `name` and each function, class and function body in it, as modules."""
    reference: Any = chapter_reference(chapter)[name]
    function = getattr(reference, "fn", reference)  # a Triton JITFunction wraps the Python function
    tree = _strip(ast.parse(textwrap.dedent(inspect.getsource(function))))
    candidates = [tree]
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            candidates.append(ast.Module(body=[node], type_ignores=[]))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            candidates.append(ast.Module(body=node.body, type_ignores=[]))
    return candidates


def has_gap(code: str) -> bool:
    """A `...` placeholder (in code or in a comment) or a comment asking the learner to fill something in."""
    return "..." in code or any(_GAP_COMMENT.search(line) for line in code.splitlines())


def _header(node: ast.stmt) -> str:
    """One statement as a line: a compound statement by its header only (its body's statements count apart)."""
    match node:
        case ast.If(test=test) | ast.While(test=test):
            return f"{type(node).__name__.lower()} {ast.unparse(test)}:"
        case ast.For(target=target, iter=iterable) | ast.AsyncFor(target=target, iter=iterable):
            return f"for {ast.unparse(target)} in {ast.unparse(iterable)}:"
        case ast.With(items=items) | ast.AsyncWith(items=items):
            return "with " + ", ".join(ast.unparse(item) for item in items) + ":"
        case ast.Try():
            return "try:"
    return ast.unparse(node)


def statements(tree: ast.AST) -> Counter[str]:
    """The statements in `tree` that do something (not a def or class line, a docstring, `pass` or `...`)."""
    found: Counter[str] = Counter()
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt) or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        if isinstance(node, ast.Pass) or isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        found[" ".join(_header(node).split())] += 1
    return found


def hint_statements(code: str) -> Counter[str]:
    """The statements of a hint's code block; a fragment that does not parse whole is read line by line (a line that
    opens a block is read as its header)."""
    try:
        return statements(_strip(ast.parse(textwrap.dedent(code))))
    except SyntaxError:
        pass
    found: Counter[str] = Counter()
    for line in code.splitlines():
        line = re.sub(r"#.*", "", line).strip()
        for attempt in (line, line.rstrip(":") + ":\n    pass"):
            try:
                found += statements(ast.parse(attempt))
                break
            except SyntaxError:
                continue
    return found


def hint_problem(code: str, candidates: list[ast.Module]) -> str | None:
    """Why this Hint 2 code gives the answer away, or None if it does not."""
    try:
        hint = _strip(ast.parse(textwrap.dedent(code)))
    except SyntaxError:  # a fragment: compare its text without comments and blank space
        hint = None
    if hint is not None and any(ast.dump(hint) == ast.dump(c) for c in candidates):
        return "it is the reference (the same code, once docstrings are dropped)"
    if has_gap(code):
        return None
    text = ast.unparse(hint) if hint is not None else " ".join(re.sub(r"#.*", "", code).split())
    similarity = max(difflib.SequenceMatcher(None, text, ast.unparse(c)).ratio() for c in candidates)
    if similarity >= SIMILARITY_LIMIT:
        return (f"it leaves no gap (no `...`, no `# TODO`) and is {similarity:.0%} similar to the reference "
                f"(limit {SIMILARITY_LIMIT:.0%})")
    return None


EXERCISES = [
    pytest.param(chapter, names, blocks, id=f"{chapter}:{'+'.join(names)}")
    for chapter in chapter_names() for names, blocks in hint_blocks(chapter)
]


@pytest.mark.parametrize("chapter, names, blocks", EXERCISES)
def test_hint_2_is_not_the_reference(chapter, names, blocks):
    reference = chapter_reference(chapter)
    graded = [name for name in names if name in reference]
    assert graded, f"{chapter}: the exercise cell defining {names} has no entry in the test file's REFERENCE"
    candidates = [c for name in graded for c in reference_candidates(chapter, name)]
    problems = [(i, problem) for i, code in enumerate(blocks) if (problem := hint_problem(code, candidates))]
    assert not problems, "\n".join(
        f"{chapter}, exercise {'/'.join(names)}: Hint 2's code block {i + 1} gives the answer away: {problem}. "
        "Leave the decisive lines to the learner (`...` or a `# TODO` comment)." for i, problem in problems
    )
    shown, total = shown_statements(blocks, [reference_statements(chapter, name) for name in graded])
    assert not total or len(shown) / total < SHOWN_LIMIT, (
        f"{chapter}, exercise {'/'.join(names)}: Hint 2 shows {len(shown)} of the reference's {total} statements "
        f"(limit: under {SHOWN_LIMIT:.0%}): {sorted(shown)}. Leave the lines the exercise's question is about blank."
    )
    for name in graded:
        decisive = decisive_statements(chapter, name)
        shown_decisive = [line for line in decisive if line in sum(map(hint_statements, blocks), Counter())]
        assert not shown_decisive, (
            f"{chapter}, exercise {name}: Hint 2 shows the line(s) its question is about: {shown_decisive}. "
            "Leave them to the learner (`...`)."
        )


def decisive_statements(chapter: str, name: str) -> list[str]:
    """The statements exercise `name`'s question is about (`DECISIVE` in tests/mutants/ch<NN>.py), each checked to
    be one of the reference's statements."""
    listed = chapter_decisive(chapter).get(name)
    assert listed, (
        f"{chapter}: exercise {name} has no entry in DECISIVE of tests/mutants/ch{chapter[:2]}.py (the lines it is "
        "about)"
    )
    normalised = [" ".join(line.split()) for line in listed]
    stale = [line for line in normalised if line not in reference_statements(chapter, name)]
    assert not stale, f"{chapter}: DECISIVE[{name!r}] lists lines that are not statements of its reference: {stale}"
    return normalised


@functools.cache
def reference_statements(chapter: str, name: str) -> Counter[str]:
    reference: Any = chapter_reference(chapter)[name]
    function = getattr(reference, "fn", reference)
    return statements(_strip(ast.parse(textwrap.dedent(inspect.getsource(function)))))


def shown_statements(blocks: list[str], references: list[Counter[str]]) -> tuple[list[str], int]:
    """The reference's statements that the hint's code blocks show (each as often as both have it), and how many
    statements the reference has."""
    reference = sum(references, Counter())
    hint = sum((hint_statements(code) for code in blocks), Counter())
    return list((reference & hint).elements()), sum(reference.values())


# --- nothing under chapters/ states a decisive line ----------------------------------------------------------------

_SKIPPED_DIRS = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache"}


class KnownLeak(Exception):
    """Only the leaks listed in KNOWN_LEAKS: an xfail that any other hit turns into a failure."""


# Files that state decisive lines today, found when the lists moved out of chapters/: the statements each shows.
# Rewriting the prose (or the test) around them is the fix; then the test passes, strict xfail fails, and the entry
# goes.
KNOWN_LEAKS: dict[str, set[str]] = {
    "07_serving/test_07_serving.py": {"task.cancel()"},  # until_disconnected's line, in the tests' own client code
}


@functools.cache
def all_decisive() -> dict[str, list[str]]:
    """Every chapter's decisive statements, whitespace-normalised -> the exercises ("ch04:BlockPool") listing it."""
    found: dict[str, list[str]] = {}
    for chapter in chapter_names():
        for name, lines in chapter_decisive(chapter).items():
            for line in lines:
                found.setdefault(" ".join(line.split()), []).append(f"ch{chapter[:2]}:{name}")
    return found


@functools.cache
def _decisive_pattern(statement: str) -> re.Pattern[str]:
    """`statement` in whitespace-normalised text, whole: not the tail of an attribute chain or a longer name, and not
    the start of a longer expression (`n` in `n + 1`, `f(x)` in `f(x).y`); prose or a next line may follow."""
    return re.compile(r"(?<![\w.])" + re.escape(statement) + r"(?![\w.(\[])(?! ?[-+*/%@&|^<>=!~])")


def decisive_hits(text: str, code: bool, decisive: dict[str, list[str]] | None = None) -> set[str]:
    """The decisive statements `text` states: as text once blank space is normalised, and for code (`code`) also as
    statements however they are laid out (`hint_statements`: quotes, wrapping, parentheses)."""
    decisive = all_decisive() if decisive is None else decisive
    normalised = " ".join(text.split())
    hits = {line for line in decisive if _decisive_pattern(line).search(normalised)}
    if code:
        hits |= decisive.keys() & hint_statements(text).keys()
    return hits


def _output_texts(output: nbformat.NotebookNode) -> list[str]:
    """The text a stored output shows: stream text, text/* and JSON data, an error's value and traceback."""
    texts = [output.get("text", ""), output.get("evalue", ""), "\n".join(output.get("traceback", []))]
    for mime, data in output.get("data", {}).items():
        if mime.startswith("text/") or mime.endswith("json"):
            texts.append(data if isinstance(data, str) else json.dumps(data))
    return [t for t in texts if t]


def file_texts(path: Path) -> list[tuple[str, str, bool]]:
    """(where, text, is it code) for everything a learner can read in `path`. A notebook gives each cell's source
    and stored outputs, except the sources of its exercise cells while they are all stubs (the shipped notebook):
    what a stub gives is the exercise's frame, and the hint rule above judges the skeleton."""
    if path.suffix != ".ipynb":
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # an image or other binary asset: nothing to read as text
            return []
        return [(path.name, text, path.suffix == ".py")]
    nb = nbformat.read(path, as_version=4)
    exercises = {id(cell) for cell in exercise_cells(nb)}
    shipped_stub = all("NotImplementedError" in cell.source for cell in exercise_cells(nb))
    found = []
    for i, cell in enumerate(nb.cells):
        if not (shipped_stub and id(cell) in exercises):
            found.append((f"{path.name} cell {i} ({cell.cell_type})", cell.source, cell.cell_type == "code"))
            if cell.cell_type == "markdown":
                blocks = _CODE_BLOCK.findall(cell.source)
                found += [(f"{path.name} cell {i}, a code block", block, True) for block in blocks]
        outputs = [text for output in cell.get("outputs", []) for text in _output_texts(output)]
        found += [(f"{path.name} cell {i}, an output", text, False) for text in outputs]
    return found


def file_hits(path: Path) -> dict[str, set[str]]:
    """where in `path` -> the decisive statements stated there."""
    return {where: hits for where, text, code in file_texts(path) if (hits := decisive_hits(text, code))}


CHAPTER_FILES = sorted(
    p.relative_to(CHAPTERS).as_posix() for p in CHAPTERS.rglob("*")
    if p.is_file() and not _SKIPPED_DIRS.intersection(p.relative_to(CHAPTERS).parts)
)


@pytest.mark.parametrize("relative", [
    pytest.param(relative, marks=pytest.mark.xfail(
        strict=True, raises=KnownLeak,
        reason=f"states {len(KNOWN_LEAKS[relative])} decisive line(s) (KNOWN_LEAKS); a new one fails outright",
    )) if relative in KNOWN_LEAKS else relative
    for relative in CHAPTER_FILES
])
def test_no_file_under_chapters_states_a_decisive_line(relative):
    hits = file_hits(CHAPTERS / relative)
    stated = set().union(*hits.values())
    new = {where: sorted(lines - KNOWN_LEAKS.get(relative, set())) for where, lines in hits.items()}
    new = {where: lines for where, lines in new.items() if lines}
    assert not new, "\n".join(
        f"chapters/{relative}: {where} states decisive line(s) {lines} "
        f"({', '.join(e for line in lines for e in all_decisive()[line])}): a learner reading it has the answer. "
        "Leave them to tests/mutants/ (the grader's side)." for where, lines in new.items()
    )
    if stated:
        raise KnownLeak(f"chapters/{relative} states {len(stated)} known decisive line(s): {sorted(stated)}")


def test_every_chapter_file_is_read():
    """The scan covers the chapters' test files, notebooks and data files (it found something to read in each)."""
    suffixes = Counter(Path(relative).suffix for relative in CHAPTER_FILES)
    assert suffixes[".py"] >= 12 and suffixes[".ipynb"] >= 12 and suffixes[".json"] >= 1, suffixes
    assert all(file_texts(CHAPTERS / relative) for relative in CHAPTER_FILES if relative.endswith((".py", ".ipynb")))
    assert not any("DECISIVE" in (CHAPTERS / r).read_text() for r in CHAPTER_FILES if r.endswith(".py"))


# --- every Hint 1 asks questions ----------------------------------------------------------------------------------

_HINT_1 = re.compile(r"<details>\s*<summary>\s*Hint 1.*?</details>", re.DOTALL)
_PITFALL = re.compile(r"pitfall", re.IGNORECASE)
MIN_QUESTIONS = 2


def hint_1_problems(markdown: str) -> list[str]:
    """Why each Hint 1 in `markdown` (a markdown cell's source) breaks the rule of issue 51, "every hint 1 asks
    questions (not a list of pitfalls)": fewer than MIN_QUESTIONS question marks, or pitfall wording (a list of
    pitfalls, each stating its fix, is the answer)."""
    problems = []
    for hint in _HINT_1.findall(markdown):
        first = " ".join(hint.split())[:80]
        if hint.count("?") < MIN_QUESTIONS:
            problems.append(f"asks {hint.count('?')} question(s) (at least {MIN_QUESTIONS}): {first!r}")
        if _PITFALL.search(hint):
            problems.append(f"lists pitfalls instead of asking about the situations: {first!r}")
    return problems


def hint_1_cells(chapter: str) -> list[tuple[str, str]]:
    """(cell id, source) of every markdown cell of the chapter's notebook holding a Hint 1."""
    nb = nbformat.read(CHAPTERS / chapter / f"{chapter}.ipynb", as_version=4)
    return [(cell.get("id", str(i)), cell.source) for i, cell in enumerate(nb.cells)
            if cell.cell_type == "markdown" and _HINT_1.search(cell.source)]


@pytest.mark.parametrize("chapter", chapter_names())
def test_every_hint_1_asks_questions(chapter):
    cells = hint_1_cells(chapter)
    assert cells, f"{chapter}: no Hint 1 found in its notebook"
    problems = [f"{chapter}, cell {cell_id}: Hint 1 {problem}" for cell_id, source in cells
                for problem in hint_1_problems(source)]
    assert not problems, "\n".join(problems) + "\nAsk the questions that lead to each decision; leave the answers out."


# --- the check itself can fail ------------------------------------------------------------------------------------


def test_a_hint_2_equal_to_the_reference_is_caught():
    """The reference's own source as a hint, whole or as its body, with or without its docstring, is flagged;
    so is the body with a line dropped and no gap; the shipped skeleton passes."""
    candidates = reference_candidates("05_continuous_batching", "apply_min_p")
    from solutions.sample.sampler import apply_min_p

    source = textwrap.dedent(inspect.getsource(apply_min_p))
    body = ast.unparse(candidates[0].body[0].body)
    assert "the reference" in (hint_problem(source, candidates) or "")
    assert "the reference" in (hint_problem(body, candidates) or "")
    assert "the reference" in (hint_problem("# the answer\n" + body + "  # done", candidates) or "")
    ((_, (skeleton,)),) = [(n, b) for n, b in hint_blocks("05_continuous_batching") if n == ["apply_min_p"]]
    assert hint_problem(skeleton, candidates) is None, "the shipped skeleton of apply_min_p was flagged"
    longer = reference_candidates("05_continuous_batching", "allocate_or_preempt")
    full = ast.unparse(longer[0].body[0].body).splitlines()
    assert "similar" in (hint_problem("\n".join(full[:-1]), longer) or ""), "the body minus its last line passed"
    assert hint_problem("\n".join(full[:-1] + ["return ..."]), longer) is None


def test_a_hint_2_showing_half_the_reference_is_caught_whatever_its_gaps():
    """The reference's body with its last line turned into a gap passes the similarity rule (it has a `...`) but
    shows nearly every statement; the same body with every line a gap shows none."""
    reference = reference_statements("05_continuous_batching", "allocate_or_preempt")
    body = ast.unparse(reference_candidates("05_continuous_batching", "allocate_or_preempt")[0].body[0].body)
    lines = body.splitlines()
    shown, total = shown_statements(["\n".join(lines[:-1] + ["return ..."])], [reference])
    assert len(shown) / total >= SHOWN_LIMIT, f"only {len(shown)} of {total} statements counted as shown"
    gaps = "\n".join(line[: len(line) - len(line.lstrip())] + "... # your code" for line in lines)
    assert shown_statements([gaps], [reference])[0] == []


def test_a_hint_2_showing_a_decisive_line_is_caught():
    """A skeleton that is all gaps but for one of the lines the exercise is about is caught; all gaps is not."""
    decisive = decisive_statements("05_continuous_batching", "allocate_or_preempt")
    body = ast.unparse(reference_candidates("05_continuous_batching", "allocate_or_preempt")[0].body[0].body)
    lines = body.splitlines()
    gaps = [line[: len(line) - len(line.lstrip())] + "... # your code" for line in lines]
    with_one = [line if " ".join(line.split()) == decisive[0] else gap for line, gap in zip(lines, gaps)]
    assert with_one != gaps, f"the decisive line {decisive[0]!r} is not a line of the reference's body"
    hinted = sum(map(hint_statements, ["\n".join(with_one)]), Counter())
    assert decisive[0] in hinted and not any(line in hint_statements("\n".join(gaps)) for line in decisive)


def test_a_file_under_chapters_stating_a_decisive_line_is_caught(tmp_path):
    """A decisive line in a test file (re-wrapped), a markdown cell, a hint's code block or a stored output is caught;
    the same line in a stub's exercise cell is not read; a longer statement that merely starts like one is no hit."""
    line = chapter_decisive("03_block_manager")["generate_paged"][1]
    assert line == "seq.num_computed_tokens += n"
    fake = tmp_path / "test_fake.py"
    fake.write_text("def test_it(seq, n):\n    seq.num_computed_tokens  +=  (\n        n\n    )\n")
    assert file_hits(fake) == {"test_fake.py": {line}}
    fake.write_text("def test_it(seq, n):\n    seq.num_computed_tokens += num_new\n"
                    "    seq.num_computed_tokens += n + 1  # not: seq.num_computed_tokens += n * 2\n")
    assert file_hits(fake) == {}
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(f"def f(seq, n):\n    {line}\n    raise NotImplementedError",
                                  metadata={"tags": ["exercise"]}),
        nbformat.v4.new_markdown_cell(f"Then `{line}` moves the sequence on."),
        nbformat.v4.new_markdown_cell(f"<summary>Hint 2</summary>\n\n```python\n{line}\n```\n</details>"),
        nbformat.v4.new_code_cell("demo()", outputs=[nbformat.v4.new_output("stream", text=f"ran: {line}\n")]),
    ])
    path = tmp_path / "fake.ipynb"
    nbformat.write(nb, path)
    assert sorted(file_hits(path)) == ["fake.ipynb cell 1 (markdown)", "fake.ipynb cell 2 (markdown)",
                                       "fake.ipynb cell 2, a code block", "fake.ipynb cell 3, an output"]
    nb.cells[0].source = f"def f(seq, n):\n    {line}"  # filled in: no longer the shipped stub, so it is read
    nbformat.write(nb, path)
    assert "fake.ipynb cell 0 (code)" in file_hits(path)


# --- no answer stored under a stub or a question ---------------------------------------------------------------


def stored_answers(nb: nbformat.NotebookNode) -> list[str]:
    """The answer cells (`is_answer`) that store an output or an execution count, as "cell i: its first line"."""
    return [f"cell {i}: {cell.source.splitlines()[0]}" for i, cell in enumerate(nb.cells)
            if is_answer(cell) and (cell.outputs or cell.execution_count is not None)]


def prediction_problems(nb: nbformat.NotebookNode) -> list[str]:
    """A "Predict first" question with no `predict` cell after it (before the next question), one that does not ask
    the learner to write the prediction down, or a `predict` cell that answers no question."""
    questions = [i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and _PREDICT_PROMPT.search(c.source)]
    tagged = [(i, c) for i, c in enumerate(nb.cells) if PREDICT_TAG in c.metadata.get("tags", [])]
    predicts = [i for i, c in tagged if c.cell_type == "code"]
    problems = []
    for question, following in zip(questions, [*questions[1:], len(nb.cells)], strict=True):
        if not any(question < i < following for i in predicts):
            problems.append(f"cell {question}: a Predict-first question with no `{PREDICT_TAG}` cell after it")
        source = nb.cells[question].source
        if not _WRITE_IT_DOWN.search(source[_PREDICT_PROMPT.search(source).start():]):
            problems.append(f"cell {question}: a Predict-first question that does not ask to write the prediction down")
    problems += [f"cell {i}: a `{PREDICT_TAG}` cell after no Predict-first question"
                 for i in predicts if not any(q < i for q in questions)]
    return problems



def unfolded_answers(nb: nbformat.NotebookNode) -> list[str]:
    """Prose that reads a `predict` cell's result in the open: the first markdown cell after a predict cell must
    fold it (`<details>`), or start a new section (a heading), so the answer is not on the page before the run."""
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or PREDICT_TAG not in cell.metadata.get("tags", []):
            continue
        following = next((j for j in range(i + 1, len(nb.cells)) if nb.cells[j].cell_type == "markdown"), None)
        if following is not None and not nb.cells[following].source.lstrip().startswith(("<details>", "#")):
            problems.append(f"cell {following}: {nb.cells[following].source.splitlines()[0][:60]}")
    return problems

def shipped_notebook(chapter: str) -> nbformat.NotebookNode:
    return nbformat.read(CHAPTERS / chapter / f"{chapter}.ipynb", as_version=4)


@pytest.mark.parametrize("chapter", chapter_names())
def test_no_shipped_notebook_stores_an_answer(chapter):
    stored = stored_answers(shipped_notebook(chapter))
    assert not stored, (f"chapters/{chapter}: outputs of check or predict cells are answers a learner sees before "
                        f"running anything (run `python -m grading.notebooks {chapter}`): {stored}")


@pytest.mark.parametrize("chapter", chapter_names())
def test_every_predict_first_question_is_answered_by_a_predict_cell(chapter):
    problems = prediction_problems(shipped_notebook(chapter))
    assert not problems, f"chapters/{chapter}: {problems}"



@pytest.mark.parametrize("chapter", chapter_names())
def test_prose_after_a_predict_cell_is_folded(chapter):
    problems = unfolded_answers(shipped_notebook(chapter))
    assert not problems, f"chapters/{chapter}: fold these in <details> (the answer to the question above): {problems}"


def test_an_unfolded_answer_is_caught():
    """Open prose after a predict cell is caught, past the code cells between; a fold or a new section is not."""
    question = nbformat.v4.new_markdown_cell("**Predict first:** what does `f()` print? Write your prediction down.")
    run = nbformat.v4.new_code_cell("f()", metadata={"tags": [PREDICT_TAG]})
    nb = nbformat.v4.new_notebook(cells=[question, run, nbformat.v4.new_code_cell("plot()"),
                                         nbformat.v4.new_markdown_cell("It prints 3, because...")])
    assert unfolded_answers(nb) == ["cell 3: It prints 3, because..."]
    for prose in ("<details><summary>Answer</summary>\n\nIt prints 3.\n</details>", "## 5. Next section"):
        nb.cells[3] = nbformat.v4.new_markdown_cell(prose)
        assert unfolded_answers(nb) == []

def test_the_chapters_ask_predict_first_questions():
    """The rule above reads something: most chapters ask, and tag the cells that answer."""
    tagged = [c for chapter in chapter_names() for c in shipped_notebook(chapter).cells
              if PREDICT_TAG in c.metadata.get("tags", [])]
    assert len(tagged) >= 12, len(tagged)


def test_a_stored_answer_is_caught():
    """A verdict under a check cell and an output under a predict cell are caught; the same cells bare, and a demo's
    output, are not; a question without its predict cell, or without asking for a prediction, is caught."""
    passed = nbformat.v4.new_output("stream", text="exercise 'f': all 3 tests passed\n")
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("def f():\n    raise NotImplementedError", metadata={"tags": ["exercise"]}),
        nbformat.v4.new_code_cell('check("f")', outputs=[passed], execution_count=2),
        nbformat.v4.new_markdown_cell("**Predict first:** what does `f()` print? Write your prediction down."),
        nbformat.v4.new_code_cell("f()", metadata={"tags": ["predict"]}, execution_count=3,
                                  outputs=[nbformat.v4.new_output("stream", text="42\n")]),
        nbformat.v4.new_code_cell("plot()", execution_count=4,
                                  outputs=[nbformat.v4.new_output("stream", text="a demo's output\n")]),
    ])
    assert stored_answers(nb) == ['cell 1: check("f")', "cell 3: f()"]
    assert prediction_problems(nb) == []
    for cell in nb.cells[1], nb.cells[3]:
        cell.outputs, cell.execution_count = [], None
    assert stored_answers(nb) == []
    nb.cells[3].metadata = {}
    nb.cells[2].source = "**Predict first:** what does `f()` print?"
    assert prediction_problems(nb) == [
        "cell 2: a Predict-first question with no `predict` cell after it",
        "cell 2: a Predict-first question that does not ask to write the prediction down",
    ]


def test_a_hint_1_listing_pitfalls_is_caught():
    """A Hint 1 that states the steps and ends with a pitfall list is flagged (too few questions, pitfall wording);
    one with a single question is flagged; the same content asked as questions passes, and so does a Hint 2."""
    stated = ("<details><summary>Hint 1: the idea, and the pitfalls</summary>\n\nWalk the table in order and stop at "
              "the first miss.\n\nPitfalls the tests catch: counting blocks after a miss; taking references.\n"
              "</details>")
    problems = hint_1_problems(stated)
    assert len(problems) == 2 and "question" in problems[0] and "pitfalls" in problems[1], problems
    no_wording = stated.replace("Pitfalls the tests catch", "Beware").replace(", and the pitfalls", "")
    statements_only = hint_1_problems(no_wording)
    assert len(statements_only) == 1 and "0 question(s)" in statements_only[0], statements_only
    with_questions = hint_1_problems(stated.replace(".\n\nPitfalls", "? Why? Pitfalls"))
    assert len(with_questions) == 1 and "pitfalls" in with_questions[0], with_questions
    one = "<details><summary>Hint 1: the idea</summary>\n\nWhere does the walk stop?\n</details>"
    assert len(hint_1_problems(one)) == 1
    asked = ("<details><summary>Hint 1: the idea</summary>\n\nIn which order do you walk the table, and where does "
             "it stop? After a miss, can a later block still be used? Is a reference yours to take?\n</details>")
    assert hint_1_problems(asked) == []
    assert hint_1_problems(asked + "\n\n<details><summary>Hint 2: a skeleton</summary>\n\nPitfall\n</details>") == []
