r"""MkDocs hooks: publish the chapter notebooks from `chapters/` without copying them into `docs/`, and render math.

The notebooks live next to their grading tests in `chapters/NN_slug/`, and that is where learners open them.
The site reads them from there:

- `on_config` builds the navigation: Home, the engine's spine (spine.md), then one entry per chapter notebook.
- `on_files` adds each `chapters/*/*.ipynb` (and the images beside them) to the site's files, before
  mkdocs-jupyter turns notebooks into pages. Tests, Python modules and caches in `chapters/` are not published.
- `on_page_markdown` resolves the course map's `[Title](chapter:NN)` links: a link to chapter NN's page when
  its notebook exists, the plain title marked "coming" when it does not. So a chapter shows up on the home page
  as soon as its notebook lands, and `mkdocs build --strict` never sees a link to a missing page.
- `on_page_content` renders the math, at build time, into MathML, which browsers draw natively: no script and
  no network request when a page loads, so formulas read the same offline (`mkdocs serve` on a train, a mirror).
  The converter is the `math-core` package (pinned in requirements.txt), which turns TeX into MathML Core.
  It looks for TeX in two places only, so a `$` in code is never touched:
    - Markdown pages: pymdownx.arithmatex (`generic: true`) wraps each formula, `\(...\)` or `\[...\]`, in an
      element of class `arithmatex`;
    - notebook pages: nbconvert leaves `$...$`, `$$...$$` (and `\(...\)`, `\[...\]`, `\begin{env}...\end{env}`)
      as text in the rendered Markdown cells (`jp-RenderedMarkdown`); text inside `<code>` and `<pre>` is skipped.
  A formula the converter rejects is a warning that names the page and the TeX, so `--strict` fails on it.
  The hook also removes the MathJax loader that nbconvert puts in every notebook page (it would fetch MathJax 2
  from a CDN).
"""

from __future__ import annotations

import logging
import re
from html import unescape
from pathlib import Path

from math_core import LatexError, LatexToMathML
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS_DIR = "chapters"
# Files a notebook may show beside itself (diagrams in Markdown cells). Everything else stays out of the site.
ASSET_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp"}
SKIPPED_DIRS = {".ipynb_checkpoints", "__pycache__"}

_CHAPTER_LINK = re.compile(r"\[([^\]]+)\]\(chapter:(\d\d)\)")
_NBCONVERT_MATHJAX = re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->", re.DOTALL)

log = logging.getLogger("mkdocs.hooks.math")  # a warning under "mkdocs" fails `mkdocs build --strict`
_TO_MATHML = LatexToMathML(fancy_error=False)  # compact one-line error messages
# Where TeX may be: a notebook's rendered Markdown cell, or a formula that pymdownx.arithmatex wrapped.
_MATH_REGION = re.compile(r'<(div|span)\b[^>]*\bclass="[^"]*\b(?:jp-RenderedMarkdown|arithmatex)\b[^"]*"[^>]*>')
# Inside a region: what is never math (tags, comments, code, scripts), kept as it is; the text between is scanned.
_NOT_TEXT = re.compile(r"<(pre|code|script|style)\b.*?</\1\s*>|<!--.*?-->|<[^>]*>", re.DOTALL | re.IGNORECASE)
# TeX delimiters as Jupyter and MathJax read them, display before inline; `\$` is a literal dollar, not a delimiter.
_TEX = re.compile(
    r"(?<!\\)\$\$(?P<display>.+?)(?<!\\)\$\$"
    r"|\\\[(?P<display_bracket>.+?)\\\]"
    r"|(?P<environment>\\begin\{(?P<env>[A-Za-z]+\*?)\}.*?\\end\{(?P=env)\})"
    r"|\\\((?P<inline_paren>.+?)\\\)"
    r"|(?<![\\$])\$(?P<inline>[^$]+?)(?<!\\)\$",
    re.DOTALL,
)


def published_notebooks() -> list[Path]:
    """Every notebook in a chapter folder, `chapters/*/*.ipynb`, relative to the repository root, sorted."""
    notebooks = (ROOT / CHAPTERS_DIR).glob("*/*.ipynb")
    return sorted(p.relative_to(ROOT) for p in notebooks if not SKIPPED_DIRS & set(p.parts))


def chapter_notebooks() -> list[Path]:
    """The chapters themselves, `chapters/NN_slug/NN_slug.ipynb`, in chapter order."""
    return [p for p in published_notebooks() if p.stem == p.parent.name]


def _chapter_assets() -> list[Path]:
    found = (ROOT / CHAPTERS_DIR).rglob("*")
    return sorted(
        p.relative_to(ROOT)
        for p in found
        if p.is_file() and p.suffix.lower() in ASSET_SUFFIXES and not SKIPPED_DIRS & set(p.parts)
    )


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    if config.nav is None:
        # Titles come from each notebook's first `# heading`.
        chapters = [p.as_posix() for p in chapter_notebooks()]
        config.nav = [{"Home": "index.md"}, {"The engine's spine": "spine.md"}] + ([{"Chapters": chapters}] if chapters else [])
    return config


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns the notebooks into pages
def on_files(files: Files, config: MkDocsConfig) -> Files:
    for rel in published_notebooks() + _chapter_assets():
        files.append(
            File(
                rel.as_posix(),
                src_dir=str(ROOT),
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
            )
        )
    return files


def _chapter_page(number: str, page: Page) -> str | None:
    """The link from `page` to chapter `number`'s notebook, or None while that chapter has no notebook."""
    for notebook in chapter_notebooks():
        if notebook.stem.startswith(f"{number}_"):
            depth = page.file.src_uri.count("/")
            return "../" * depth + notebook.as_posix()
    return None


def on_page_markdown(markdown: str, page: Page, **kwargs) -> str:
    def resolve(match: re.Match[str]) -> str:
        title, number = match.groups()
        target = _chapter_page(number, page)
        return f"[{title}]({target})" if target else f"{title} *(coming)*"

    return _CHAPTER_LINK.sub(resolve, markdown)


def _region_end(content: str, tag: str, start: int) -> int:
    """Where the element opened just before `start` closes: the index of its matching `</tag>`, or len(content)."""
    depth = 1
    for match in re.finditer(rf"<(/?){tag}\b[^>]*>", content[start:]):
        depth += -1 if match.group(1) else 1
        if depth == 0:
            return start + match.start()
    return len(content)


def _tex_to_mathml(text: str, where: str) -> str:
    """Replace each formula in `text` (HTML-escaped text between tags) by MathML; leave the rest as it is."""

    def convert(match: re.Match[str]) -> str:
        display = match.lastgroup in ("display", "display_bracket", "environment")
        tex = unescape(match.group(match.lastgroup)).strip()
        try:
            return _TO_MATHML.convert_with_local_state(tex, displaystyle=display)
        except LatexError as error:
            log.warning("%s: the formula %r does not convert to MathML: %s", where, tex, error)
            return match.group(0)

    return _TEX.sub(convert, text).replace("\\$", "$")


def render_math(content: str, where: str = "page") -> str:
    """Replace the TeX in `content`'s math regions (see the module docstring) by MathML; `where` names the page."""
    out: list[str] = []
    done = 0
    for region in _MATH_REGION.finditer(content):
        if region.start() < done:  # a region nested in one already converted
            continue
        end = _region_end(content, region.group(1), region.end())
        out.append(content[done : region.end()])
        inner = content[region.end() : end]
        pos = 0
        for keep in _NOT_TEXT.finditer(inner):
            out.append(_tex_to_mathml(inner[pos : keep.start()], where))
            out.append(keep.group(0))
            pos = keep.end()
        out.append(_tex_to_mathml(inner[pos:], where))
        done = end
    out.append(content[done:])
    return "".join(out)


def on_page_content(html: str, page: Page, **kwargs) -> str:
    if page.file.src_uri.endswith(".ipynb"):
        html = _NBCONVERT_MATHJAX.sub("", html)
    return render_math(html, page.file.src_uri)
