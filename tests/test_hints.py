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
- it shows one of the statements the exercise's question is about: the chapter's test file lists them per exercise
  (`DECISIVE`, beside `REFERENCE`), each of which must be a statement of the reference, so the list cannot go stale.
"""

import ast
import difflib
import functools
import inspect
import re
import textwrap
from collections import Counter
from typing import Any

import nbformat
import pytest

from grading import CHAPTERS
from grading.notebook import EXERCISE_TAG, defined_names
from grading.notebooks import chapter_decisive, chapter_reference

SIMILARITY_LIMIT = 0.9
SHOWN_LIMIT = 0.5  # a hint showing this share of the reference's statements, or more, gives the answer away
_GAP_COMMENT = re.compile(r"#.*\b(todo|your|fill)\b", re.IGNORECASE)
_HINT_2 = re.compile(r"<summary>\s*Hint 2.*?</details>", re.DOTALL)
_CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


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
    """The statements exercise `name`'s question is about (the test file's `DECISIVE`), each checked to be one of
    the reference's statements."""
    listed = chapter_decisive(chapter).get(name)
    assert listed, f"{chapter}: exercise {name} has no entry in the test file's DECISIVE (the lines it is about)"
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
