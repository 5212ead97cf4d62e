"""MkDocs hooks: publish the chapter notebooks from `chapters/` without copying them into `docs/`.

The notebooks live next to their grading tests in `chapters/NN_slug/`, and that is where learners open them.
The site reads them from there:

- `on_config` builds the navigation: Home, then one entry per chapter notebook, in chapter order.
- `on_files` adds each `chapters/*/*.ipynb` (and the images beside them) to the site's files, before
  mkdocs-jupyter turns notebooks into pages. Tests, Python modules and caches in `chapters/` are not published.
- `on_page_markdown` resolves the course map's `[Title](chapter:NN)` links: a link to chapter NN's page when
  its notebook exists, the plain title marked "coming" when it does not. So a chapter shows up on the home page
  as soon as its notebook lands, and `mkdocs build --strict` never sees a link to a missing page.
- `on_page_content` removes the MathJax 2 loader that nbconvert puts in every notebook page: the site loads one
  MathJax 3 for Markdown pages and notebooks alike (`docs/javascripts/mathjax.js`); two versions on one page
  fight over `window.MathJax`.
"""

from __future__ import annotations

import re
from pathlib import Path

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
        config.nav = [{"Home": "index.md"}] + ([{"Chapters": chapters}] if chapters else [])
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


def on_page_content(html: str, page: Page, **kwargs) -> str:
    if page.file.src_uri.endswith(".ipynb"):
        html = _NBCONVERT_MATHJAX.sub("", html)
    return html
